From KVCert Require Import Prelim.
From Coq Require Import Reals Lra Lia.
Open Scope R_scope.

(** T1 and T2 of math.md: how far the softmax of perturbed logits can move, in total
    variation, given bounds on the logit shifts. [p] is the exact distribution
    [softmax n x], [p~] the served one [softmax n x~], [eps = x - x~]. *)

(** * Generic facts *)

Lemma exp_mono x y : x <= y -> exp x <= exp y.
Proof.
  intros [H|H]; [left; apply exp_increasing; exact H|subst; lra].
Qed.

Lemma one_le_exp x : 0 <= x -> 1 <= exp x.
Proof. intros H. rewrite <- exp_0. apply exp_mono. exact H. Qed.

Lemma abs_le_between x c : Rabs x <= c -> - c <= x <= c.
Proof. unfold Rabs. destruct (Rcase_abs x); lra. Qed.

Lemma abs_eq_pos_part x : Rabs x = 2 * Rmax 0 x - x.
Proof.
  unfold Rabs, Rmax. destruct (Rcase_abs x); destruct (Rle_dec 0 x); lra.
Qed.

Lemma tv_ext n p p' q q' :
  (forall j, (j < n)%nat -> p j = p' j) -> (forall j, (j < n)%nat -> q j = q' j) ->
  tv n p q = tv n p' q'.
Proof.
  intros Hp Hq. unfold tv. f_equal. apply sum_ext. intros j Hj.
  rewrite Hp, Hq by exact Hj. reflexivity.
Qed.

(** For two vectors of equal mass, TV is the total positive part of [p - q]. *)
Lemma tv_eq_sum_pos_part n p q :
  sum n p = sum n q -> tv n p q = sum n (fun j => Rmax 0 (p j - q j)).
Proof.
  intros H. unfold tv.
  rewrite (sum_ext n _ (fun j => 2 * Rmax 0 (p j - q j) - (p j - q j)))
    by (intros; apply abs_eq_pos_part).
  rewrite sum_sub, sum_scal_l, sum_sub, H. lra.
Qed.

Lemma sum_weighted_bounds n u f m M :
  (forall j, (j < n)%nat -> 0 <= u j) -> (forall j, (j < n)%nat -> m <= f j <= M) ->
  m * sum n u <= sum n (fun j => u j * f j) <= M * sum n u.
Proof.
  intros Hu Hf. rewrite <- !sum_scal_l. split; apply sum_le; intros j Hj;
    specialize (Hu j Hj); specialize (Hf j Hj); nra.
Qed.

Lemma sum_pos_weighted n q e :
  (forall j, (j < n)%nat -> 0 <= q j) -> (forall j, (j < n)%nat -> 0 < e j) ->
  0 < sum n q -> 0 < sum n (fun j => q j * e j).
Proof.
  induction n as [|n IH]; intros Hq He Hs; simpl in *; [lra|].
  assert (0 <= sum n q) by (apply sum_nonneg; intros; apply Hq; lia).
  assert (0 <= sum n (fun j => q j * e j))
    by (apply sum_nonneg; intros j Hj; apply Rmult_le_pos; [apply Hq|left; apply He]; lia).
  assert (Hqn : 0 <= q n) by (apply Hq; lia). assert (Hen : 0 < e n) by (apply He; lia).
  destruct (Rle_lt_dec (sum n q) 0) as [Hs0|Hs0].
  - assert (0 < q n) by lra. assert (0 < q n * e n) by (apply Rmult_lt_0_compat; lra). lra.
  - assert (0 < sum n (fun j => q j * e j)) by (apply IH; [intros; apply Hq; lia|intros; apply He; lia|lra]).
    assert (0 <= q n * e n) by (apply Rmult_le_pos; lra). lra.
Qed.

Lemma tanh_eq y : tanh y = (exp (2 * y) - 1) / (exp (2 * y) + 1).
Proof.
  unfold tanh, sinh, cosh. replace (2 * y) with (y + y) by ring.
  rewrite exp_plus, exp_Ropp. assert (0 < exp y) by apply exp_pos.
  field. split; nra.
Qed.

Lemma softmax_pos n x j : (0 < n)%nat -> 0 < softmax n x j.
Proof.
  intros Hn. unfold softmax. apply Rdiv_lt_0_compat; [apply exp_pos|].
  apply sum_pos; [exact Hn|intros; apply exp_pos].
Qed.

Lemma softmax_nonneg n x j : (0 < n)%nat -> 0 <= softmax n x j.
Proof. intros Hn. left. apply softmax_pos. exact Hn. Qed.

(** [p_j = p~_j e^{eps_j} / Z] with [Z = sum_i p~_i e^{eps_i}]. *)
Lemma softmax_eq_tilt n x xt j :
  (0 < n)%nat ->
  softmax n x j =
  softmax n xt j * exp (x j - xt j) / sum n (fun i => softmax n xt i * exp (x i - xt i)).
Proof.
  intros Hn.
  assert (Hx : 0 < sum n (fun i => exp (x i))) by (apply sum_pos; [exact Hn|intros; apply exp_pos]).
  assert (Ht : 0 < sum n (fun i => exp (xt i))) by (apply sum_pos; [exact Hn|intros; apply exp_pos]).
  assert (Hz : sum n (fun i => softmax n xt i * exp (x i - xt i))
               = sum n (fun i => exp (x i)) * / sum n (fun i => exp (xt i))).
  { rewrite <- sum_scal_r. apply sum_ext. intros i _. unfold softmax.
    replace (exp (x i)) with (exp (xt i) * exp (x i - xt i))
      by (rewrite <- exp_plus; f_equal; ring).
    field. lra. }
  rewrite Hz. unfold softmax.
  replace (exp (x j)) with (exp (xt j) * exp (x j - xt j)) at 1
    by (rewrite <- exp_plus; f_equal; ring).
  field. split; lra.
Qed.

(** The scalar core of T1a. With [a = sum_S w f], [F = sum w f], [al = sum_S w],
    [W = sum w] for a (fractional) set [S]: [p(S) - p~(S) <= (k-1)/(k+1)]. The slack
    of the last step is [(k-1) (k al - (W - al))^2] once denominators are cleared. *)
Lemma ratio_gap m M k a F al W :
  0 < m -> m * al <= a -> a <= M * al -> m * (W - al) <= F - a -> F - a <= M * (W - al) ->
  0 <= al -> al <= W -> 0 < W -> 1 <= k -> M <= k ^ 2 * m ->
  a / F - al / W <= (k - 1) / (k + 1).
Proof.
  intros Hm Ha1 Ha2 Hb1 Hb2 Hal HalW HW Hk HM.
  assert (HmW : 0 < m * W) by (apply Rmult_lt_0_compat; lra).
  assert (HFpos : 0 < F) by lra.
  assert (HmM : m <= M).
  { assert (0 <= (M - m) * W) by nra. nra. }
  assert (Hbe : 0 <= W - al) by lra.
  assert (HD1 : 0 < M * al + m * (W - al)) by nra.
  assert (S1 : a / F <= M * al / (M * al + m * (W - al))).
  { apply Rmult_le_reg_r with (r := F * (M * al + m * (W - al))); [nra|].
    field_simplify; [|lra|lra].
    assert (a * (m * (W - al)) <= M * al * (F - a)).
    { apply Rle_trans with (M * al * (m * (W - al))).
      - apply Rmult_le_compat_r; nra.
      - apply Rmult_le_compat_l; nra. }
    nra. }
  assert (Hk2 : 0 < k ^ 2) by nra.
  assert (HD2 : 0 < k ^ 2 * al + (W - al)) by nra.
  assert (S2 : M * al / (M * al + m * (W - al)) <= k ^ 2 * al / (k ^ 2 * al + (W - al))).
  { apply Rmult_le_reg_r with (r := (M * al + m * (W - al)) * (k ^ 2 * al + (W - al))); [nra|].
    field_simplify; [|lra|lra].
    assert (M * (al * (W - al)) <= k ^ 2 * m * (al * (W - al))).
    { apply Rmult_le_compat_r; nra. }
    nra. }
  assert (S3 : k ^ 2 * al / (k ^ 2 * al + (W - al)) - al / W <= (k - 1) / (k + 1)).
  { apply Rmult_le_reg_r with (r := (k ^ 2 * al + (W - al)) * W * (k + 1));
      [apply Rmult_lt_0_compat; [apply Rmult_lt_0_compat|]; lra|].
    field_simplify; try (repeat split; lra).
    assert (0 <= (k - 1) * (k * al - (W - al)) ^ 2) by (apply Rmult_le_pos; [lra|apply pow2_ge_0]).
    nra. }
  lra.
Qed.

(** * T1: shifts confined to an interval *)

(** T1a: reweighting a distribution [w / sum w] by factors within a ratio [k^2] of each
    other moves it by at most [(k-1)/(k+1)] in TV, with no exponentials involved. *)
Theorem tv_le_k_form_of_ratio_bounds n w f m M k :
  (forall j, (j < n)%nat -> 0 <= w j) -> 0 < sum n w -> 0 < m ->
  (forall j, (j < n)%nat -> m <= f j <= M) -> 1 <= k -> M / m <= k ^ 2 ->
  tv n (fun j => w j * f j / sum n (fun i => w i * f i)) (fun j => w j / sum n w)
  <= (k - 1) / (k + 1).
Proof.
  intros Hw HW Hm Hf Hk HM.
  set (W := sum n w) in *. set (F := sum n (fun i => w i * f i)).
  assert (HF : m * W <= F <= M * W) by (apply sum_weighted_bounds; assumption).
  assert (HFpos : 0 < F) by (assert (0 < m * W) by (apply Rmult_lt_0_compat; lra); lra).
  set (p := fun j => w j * f j / F). set (q := fun j => w j / W).
  assert (Hsum : sum n p = sum n q).
  { unfold p, q, Rdiv. rewrite !sum_scal_r. fold W F. field. lra. }
  rewrite tv_eq_sum_pos_part by exact Hsum.
  set (s := fun j => if Rle_dec (p j) (q j) then 0 else 1).
  assert (Hs : forall j, 0 <= s j <= 1) by (intros j; unfold s; destruct (Rle_dec (p j) (q j)); lra).
  assert (Hsw : forall j, (j < n)%nat -> 0 <= s j * w j)
    by (intros j Hj; apply Rmult_le_pos; [apply Hs|apply Hw; exact Hj]).
  assert (Hsw' : forall j, (j < n)%nat -> 0 <= (1 - s j) * w j)
    by (intros j Hj; apply Rmult_le_pos; [specialize (Hs j); lra|apply Hw; exact Hj]).
  set (a := sum n (fun j => s j * w j * f j)). set (al := sum n (fun j => s j * w j)).
  assert (Hgap : sum n (fun j => Rmax 0 (p j - q j)) = a / F - al / W).
  { unfold a, al, Rdiv. rewrite <- !sum_scal_r, <- sum_sub. apply sum_ext. intros j _.
    unfold s, Rmax. unfold p, q.
    destruct (Rle_dec (w j * f j / F) (w j / W)); destruct (Rle_dec 0 (w j * f j / F - w j / W));
      unfold Rdiv in *; nra. }
  rewrite Hgap.
  assert (Hrest : F - a = sum n (fun j => (1 - s j) * w j * f j) /\
                  W - al = sum n (fun j => (1 - s j) * w j)).
  { unfold F, W, a, al. rewrite <- !sum_sub. split; apply sum_ext; intros; ring. }
  destruct Hrest as [Hb Hbe].
  assert (Ha : m * al <= a <= M * al) by (apply sum_weighted_bounds; assumption).
  assert (Hb' : m * (W - al) <= F - a <= M * (W - al))
    by (rewrite Hb, Hbe; apply sum_weighted_bounds; assumption).
  assert (Hal : 0 <= al) by (apply sum_nonneg; exact Hsw).
  assert (HalW : 0 <= W - al) by (rewrite Hbe; apply sum_nonneg; exact Hsw').
  assert (HMk : M <= k ^ 2 * m).
  { apply Rmult_le_compat_r with (r := m) in HM; [|lra].
    unfold Rdiv in HM. rewrite Rmult_assoc, Rinv_l in HM by lra. lra. }
  apply ratio_gap with (m := m) (M := M); try lra.
Qed.

(** T1b: if every logit moves by an amount in [[a, b]], the softmax moves by at most
    [tanh((b-a)/4)] in TV: only the spread of the shifts matters, not their size. *)
Theorem tv_le_tanh_of_shift_in_interval n x xt a b :
  (0 < n)%nat -> (forall j, (j < n)%nat -> a <= x j - xt j <= b) ->
  tv n (softmax n x) (softmax n xt) <= tanh ((b - a) / 4).
Proof.
  intros Hn Hab.
  assert (Hba : a <= b) by (specialize (Hab 0%nat Hn); lra).
  set (w := fun j => exp (xt j)). set (f := fun j => exp (x j - xt j - a)).
  assert (Hwf : forall j, w j * f j = exp (x j) * exp (- a)).
  { intros j. unfold w, f. rewrite <- !exp_plus. f_equal. ring. }
  assert (HS : sum n (fun i => w i * f i) = sum n (fun i => exp (x i)) * exp (- a)).
  { rewrite <- sum_scal_r. apply sum_ext. intros. apply Hwf. }
  assert (Hx : 0 < sum n (fun i => exp (x i))) by (apply sum_pos; [exact Hn|intros; apply exp_pos]).
  assert (Hea : 0 < exp (- a)) by apply exp_pos.
  rewrite (tv_ext n _ (fun j => w j * f j / sum n (fun i => w i * f i))
                   _ (fun j => w j / sum n w)).
  2: { intros j _. rewrite HS, Hwf. unfold softmax. field. lra. }
  2: { intros j _. reflexivity. }
  rewrite tanh_eq. replace (2 * ((b - a) / 4)) with ((b - a) / 2) by field.
  apply tv_le_k_form_of_ratio_bounds with (m := 1) (M := exp (b - a)).
  - intros. left. apply exp_pos.
  - apply sum_pos; [exact Hn|intros; apply exp_pos].
  - lra.
  - intros j Hj. specialize (Hab j Hj). unfold f. split.
    + apply one_le_exp. lra.
    + apply exp_mono. lra.
  - apply one_le_exp. lra.
  - unfold Rdiv. rewrite Rinv_1, Rmult_1_r, <- Rsqr_pow2. unfold Rsqr. rewrite <- exp_plus. right. f_equal. field.
Qed.

(** T1c: if every logit moves by at most [c] in absolute value, the softmax moves by at
    most [tanh(c/2)] in TV, which is below [c/2] and below 1. *)
Theorem tv_le_tanh_of_abs_shift_le n x xt c :
  (0 < n)%nat -> (forall j, (j < n)%nat -> Rabs (x j - xt j) <= c) ->
  tv n (softmax n x) (softmax n xt) <= tanh (c / 2).
Proof.
  intros Hn Hc. replace (c / 2) with ((c - - c) / 4) by field.
  apply tv_le_tanh_of_shift_in_interval; [exact Hn|].
  intros j Hj. apply abs_le_between. apply Hc. exact Hj.
Qed.

(** T1d: the bound [tanh(c/2)] of T1c cannot be improved: two tokens whose served logits
    differ by [c] ([xt 1 = xt 0 + c]) and whose exact logits move by [+c] and [-c] reach it
    exactly (this configuration; other two-point shifts by [+-c] stay below it). *)
Theorem tv_eq_tanh_of_two_point x xt c :
  0 <= c -> xt 1%nat = xt 0%nat + c -> x 0%nat = xt 0%nat + c -> x 1%nat = xt 1%nat - c ->
  tv 2 (softmax 2 x) (softmax 2 xt) = tanh (c / 2).
Proof.
  intros Hc H1 H2 H3.
  rewrite tanh_eq. replace (2 * (c / 2)) with c by field.
  assert (He : 1 <= exp c) by (apply one_le_exp; exact Hc).
  assert (Hu : 0 < exp (xt 0%nat)) by apply exp_pos.
  unfold tv, softmax. simpl sum. rewrite H3, H1, H2.
  replace (xt 0%nat + c - c) with (xt 0%nat) by ring. rewrite exp_plus.
  set (u := exp (xt 0%nat)) in *. set (e := exp c) in *.
  replace (u * e / (0 + u * e + u) - u / (0 + u + u * e)) with ((e - 1) / (e + 1))
    by (field; repeat split; nra).
  replace (u / (0 + u * e + u) - u * e / (0 + u + u * e)) with (- ((e - 1) / (e + 1)))
    by (field; repeat split; nra).
  rewrite Rabs_Ropp, Rabs_pos_eq by (unfold Rdiv; apply Rmult_le_pos; [lra|left; apply Rinv_0_lt_compat; lra]). field. lra.
Qed.

(** * T2: per-token shift bounds [|eps_j| <= c_j], observable through
    [A = sum_j p~_j e^{c_j}] and [B = sum_j p~_j e^{-c_j}] *)

(** T2a: for any distribution [p~] and any reals [c_j], [A * B >= 1], so [1/A <= B]:
    the two observable sums can be used to bound each other. *)
Theorem one_le_a_mul_b n q c :
  (forall j, (j < n)%nat -> 0 <= q j) -> sum n q = 1 ->
  1 <= sum n (fun j => q j * exp (c j)) * sum n (fun j => q j * exp (- c j)).
Proof.
  intros Hq Hs.
  set (A := sum n (fun j => q j * exp (c j))).
  assert (HA : 0 < A) by (apply sum_pos_weighted; [exact Hq|intros; apply exp_pos|lra]).
  assert (Hpt : forall j, (j < n)%nat ->
            2 * q j <= q j * exp (c j) * / A + A * (q j * exp (- c j))).
  { intros j Hj. specialize (Hq j Hj). rewrite exp_Ropp.
    assert (He : 0 < exp (c j)) by apply exp_pos. set (e := exp (c j)) in *.
    assert (Hsq : 0 <= q j * (e - A) ^ 2 / (A * e)).
    { unfold Rdiv. apply Rmult_le_pos; [apply Rmult_le_pos; [exact Hq|apply pow2_ge_0]|].
      left. apply Rinv_0_lt_compat. nra. }
    assert (Hid : q j * e * / A + A * (q j * / e) - 2 * q j = q j * (e - A) ^ 2 / (A * e))
      by (field; lra).
    lra. }
  apply sum_le in Hpt. rewrite sum_add, sum_scal_l, sum_scal_r, sum_scal_l, Hs in Hpt.
  fold A in Hpt. rewrite Rinv_r in Hpt by lra. lra.
Qed.

(** T2b (lower half): the normaliser [Z = sum_j p~_j e^{eps_j}] is at least [B]. *)
Theorem b_le_z_of_abs_shift_le n q eps c :
  (forall j, (j < n)%nat -> 0 <= q j) -> (forall j, (j < n)%nat -> Rabs (eps j) <= c j) ->
  sum n (fun j => q j * exp (- c j)) <= sum n (fun j => q j * exp (eps j)).
Proof.
  intros Hq Hc. apply sum_le. intros j Hj. apply Rmult_le_compat_l; [apply Hq; exact Hj|].
  apply exp_mono. destruct (abs_le_between (eps j) (c j) (Hc j Hj)). lra.
Qed.

(** T2b (upper half): the normaliser [Z = sum_j p~_j e^{eps_j}] is at most [A]. *)
Theorem z_le_a_of_abs_shift_le n q eps c :
  (forall j, (j < n)%nat -> 0 <= q j) -> (forall j, (j < n)%nat -> Rabs (eps j) <= c j) ->
  sum n (fun j => q j * exp (eps j)) <= sum n (fun j => q j * exp (c j)).
Proof.
  intros Hq Hc. apply sum_le. intros j Hj. apply Rmult_le_compat_l; [apply Hq; exact Hj|].
  apply exp_mono. destruct (abs_le_between (eps j) (c j) (Hc j Hj)). lra.
Qed.

Lemma abs_sub_le_of_ratio_le q p y :
  0 <= q -> 0 < y -> q / y <= p -> p <= q * y -> Rabs (p - q) <= q * (y - 1).
Proof.
  intros Hq Hy Hlo Hhi.
  assert (Hid : q * (y - 1) - (q - q / y) = q * (y - 1) ^ 2 / y) by (field; lra).
  assert (Hsq : 0 <= q * (y - 1) ^ 2 / y).
  { unfold Rdiv. apply Rmult_le_pos; [apply Rmult_le_pos; [exact Hq|apply pow2_ge_0]|].
    left. apply Rinv_0_lt_compat. exact Hy. }
  unfold Rabs. destruct (Rcase_abs (p - q)); lra.
Qed.

(** Each exact probability stays within a factor [A e^{c_j}] of the served one. *)
Lemma softmax_tilt_bounds n x xt c j :
  (0 < n)%nat -> (forall i, (i < n)%nat -> Rabs (x i - xt i) <= c i) -> (j < n)%nat ->
  softmax n xt j * exp (- c j) / sum n (fun i => softmax n xt i * exp (c i)) <= softmax n x j
  <= softmax n xt j * (sum n (fun i => softmax n xt i * exp (c i)) * exp (c j)).
Proof.
  intros Hn Hc Hj.
  set (q := softmax n xt).
  set (A := sum n (fun i => q i * exp (c i))).
  set (B := sum n (fun i => q i * exp (- c i))).
  set (Z := sum n (fun i => q i * exp (x i - xt i))).
  assert (Hq : forall i, (i < n)%nat -> 0 <= q i) by (intros; apply softmax_nonneg; exact Hn).
  assert (HAB : 1 <= A * B) by (apply one_le_a_mul_b; [exact Hq|apply softmax_sum; exact Hn]).
  assert (HBZ : B <= Z) by (apply b_le_z_of_abs_shift_le; assumption).
  assert (HZA : Z <= A) by (apply z_le_a_of_abs_shift_le; assumption).
  assert (HZ : 0 < Z).
  { apply sum_pos; [exact Hn|]. intros i _. apply Rmult_lt_0_compat; [apply softmax_pos; exact Hn|apply exp_pos]. }
  assert (HA : 0 < A) by lra.
  assert (HAZ : 1 <= A * Z) by nra.
  rewrite (softmax_eq_tilt n x xt j Hn). fold q Z.
  destruct (abs_le_between (x j - xt j) (c j) (Hc j Hj)) as [Hlo Hhi].
  apply exp_mono in Hlo. apply exp_mono in Hhi.
  assert (Hqj : 0 <= q j) by (apply Hq; exact Hj).
  assert (He : 0 < exp (- c j)) by apply exp_pos.
  set (e := exp (x j - xt j)) in *.
  split.
  - apply Rle_trans with (q j * exp (- c j) / Z).
    + unfold Rdiv. apply Rmult_le_compat_l; [apply Rmult_le_pos; lra|].
      apply Rinv_le_contravar; lra.
    + unfold Rdiv. apply Rmult_le_compat_r; [left; apply Rinv_0_lt_compat; lra|].
      apply Rmult_le_compat_l; lra.
  - apply Rle_trans with (q j * exp (c j) / Z).
    + unfold Rdiv. apply Rmult_le_compat_r; [left; apply Rinv_0_lt_compat; lra|].
      apply Rmult_le_compat_l; lra.
    + assert (Hinv : / Z <= A).
      { apply Rmult_le_reg_l with Z; [exact HZ|]. rewrite Rinv_r by lra. lra. }
      assert (0 <= q j * exp (c j)) by (apply Rmult_le_pos; [lra|left; apply exp_pos]).
      unfold Rdiv. replace (q j * (A * exp (c j))) with (q j * exp (c j) * A) by ring.
      apply Rmult_le_compat_l; lra.
Qed.

(** T2c: from the served distribution and the per-token bounds [c_j] alone, the exact
    softmax is within [1 - B/A] in TV, a bound that is small when the error sits on
    tokens that [p~] ignores. *)
Theorem tv_le_one_sub_b_div_a_of_abs_shift_le n x xt c :
  (0 < n)%nat -> (forall j, (j < n)%nat -> Rabs (x j - xt j) <= c j) ->
  tv n (softmax n x) (softmax n xt)
  <= 1 - sum n (fun j => softmax n xt j * exp (- c j))
         / sum n (fun j => softmax n xt j * exp (c j)).
Proof.
  intros Hn Hc.
  set (q := softmax n xt). set (p := softmax n x).
  set (A := sum n (fun j => q j * exp (c j))).
  assert (Hq : forall i, (i < n)%nat -> 0 <= q i) by (intros; apply softmax_nonneg; exact Hn).
  assert (Hsq : sum n q = 1) by (apply softmax_sum; exact Hn).
  assert (Hsp : sum n p = 1) by (apply softmax_sum; exact Hn).
  assert (HA1 : 1 <= A).
  { rewrite <- Hsq. unfold A. rewrite <- (Rmult_1_r (sum n q)), <- sum_scal_r.
    apply sum_le. intros j Hj. apply Rmult_le_compat_l; [apply Hq; exact Hj|].
    apply one_le_exp. apply Rle_trans with (Rabs (x j - xt j)); [apply Rabs_pos|apply Hc; exact Hj]. }
  rewrite tv_sym, tv_eq_sum_pos_part by lra.
  replace (1 - sum n (fun j => q j * exp (- c j)) / A)
    with (sum n (fun j => q j - q j * exp (- c j) / A))
    by (rewrite sum_sub, Hsq; unfold Rdiv; rewrite sum_scal_r; reflexivity).
  apply sum_le. intros j Hj.
  destruct (softmax_tilt_bounds n x xt c j Hn Hc Hj) as [Hlo _]. fold q p A in Hlo.
  apply Rmax_lub; [|lra].
  assert (Hcj : 0 <= c j) by (apply Rle_trans with (Rabs (x j - xt j)); [apply Rabs_pos|apply Hc; exact Hj]).
  assert (He : exp (- c j) <= 1) by (rewrite <- exp_0; apply exp_mono; lra).
  assert (0 < exp (- c j)) by apply exp_pos.
  assert (Hqj : 0 <= q j) by (apply Hq; exact Hj).
  assert (exp (- c j) / A <= 1).
  { unfold Rdiv. apply Rmult_le_reg_l with A; [lra|].
    rewrite <- Rmult_assoc, (Rmult_comm A), Rmult_assoc, Rinv_r by lra. lra. }
  assert (q j * exp (- c j) / A <= q j * 1).
  { unfold Rdiv. rewrite Rmult_assoc. apply Rmult_le_compat_l; lra. }
  lra.
Qed.

(** T2d: the same data also bound the TV by [(A^2 - 1)/2], which is the better form when
    [A] is close to 1. *)
Theorem tv_le_a_sq_form_of_abs_shift_le n x xt c :
  (0 < n)%nat -> (forall j, (j < n)%nat -> Rabs (x j - xt j) <= c j) ->
  tv n (softmax n x) (softmax n xt)
  <= (sum n (fun j => softmax n xt j * exp (c j)) ^ 2 - 1) / 2.
Proof.
  intros Hn Hc.
  set (q := softmax n xt). set (p := softmax n x).
  set (A := sum n (fun j => q j * exp (c j))).
  assert (Hq : forall i, (i < n)%nat -> 0 <= q i) by (intros; apply softmax_nonneg; exact Hn).
  assert (Hsq : sum n q = 1) by (apply softmax_sum; exact Hn).
  assert (Hsum : sum n (fun j => q j * (A * exp (c j) - 1)) = A ^ 2 - 1).
  { rewrite (sum_ext n _ (fun j => A * (q j * exp (c j)) - q j)) by (intros; ring).
    rewrite sum_sub, sum_scal_l, Hsq. fold A. ring. }
  rewrite <- Hsum. unfold tv, Rdiv. rewrite (Rmult_comm (/ 2)).
  apply Rmult_le_compat_r; [lra|].
  apply sum_le. intros j Hj.
  destruct (softmax_tilt_bounds n x xt c j Hn Hc Hj) as [Hlo Hhi]. fold q p A in Hlo, Hhi.
  assert (HA : 0 < A).
  { apply sum_pos_weighted; [exact Hq|intros; apply exp_pos|lra]. }
  assert (Hec : 0 < exp (c j)) by apply exp_pos.
  apply abs_sub_le_of_ratio_le; [apply Hq; exact Hj|apply Rmult_lt_0_compat; lra| |exact Hhi].
  replace (q j / (A * exp (c j))) with (q j * exp (- c j) / A)
    by (rewrite exp_Ropp; field; lra).
  exact Hlo.
Qed.
