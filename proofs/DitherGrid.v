(** T6 on the dither the code draws: a finite, uniform probability space over the 16-bit
    grid of fast/quant.py (u = (2 i + 1 - 2^16) / 2^17), expectation a genuine finite
    average (E 1 = 1), independence across coordinates proved as a product space, and the
    request-level failure bound. The subtractive-dither error on the grid is NOT centred:
    its mean lies within 1/(2N) + eta steps of 0 (N = 2^16, eta the extra rounding slack),
    and the centred part is sub-Gaussian with proxy (1 - 1/N^2)/12 <= 1/12. Trusted: A1
    (the hash draws the grid uniformly and independently) and A2 (queries and keys do not
    depend on the dither), both as the form of the statements, not as premises. *)
From Coq Require Import Reals Lra Lia ZArith.
From KVCert Require Import Prelim Dither.
Open Scope R_scope.

(** * A finite uniform probability space over [0, N)^M *)

Definition avg (N : nat) (f : nat -> R) : R := sum N f / INR N.

Definition upd (w : nat -> nat) (k i : nat) : nat -> nat :=
  fun j => if Nat.eqb j k then i else w j.

(** Eu N M f: the average of f over all w with w k in [0, N) for k < M (and w k = 0 beyond). *)
Fixpoint Eu (N M : nat) (f : (nat -> nat) -> R) : R :=
  match M with
  | O => f (fun _ => O)
  | S M' => Eu N M' (fun w => avg N (fun i => f (upd w M' i)))
  end.

Section Space.
Variable N : nat.
Hypothesis HN : (0 < N)%nat.

Lemma INR_N_pos : 0 < INR N.
Proof. apply lt_0_INR. exact HN. Qed.

Lemma avg_ext f g : (forall i, (i < N)%nat -> f i = g i) -> avg N f = avg N g.
Proof. intros H. unfold avg. rewrite (sum_ext _ _ _ H). reflexivity. Qed.

Lemma avg_le f g : (forall i, (i < N)%nat -> f i <= g i) -> avg N f <= avg N g.
Proof.
  intros H. unfold avg, Rdiv. apply Rmult_le_compat_r.
  - left. apply Rinv_0_lt_compat, INR_N_pos.
  - apply sum_le. exact H.
Qed.

Lemma avg_add f g : avg N (fun i => f i + g i) = avg N f + avg N g.
Proof. unfold avg. rewrite sum_add. field. apply Rgt_not_eq, INR_N_pos. Qed.

Lemma avg_scal c f : avg N (fun i => c * f i) = c * avg N f.
Proof. unfold avg. rewrite sum_scal_l. field. apply Rgt_not_eq, INR_N_pos. Qed.

Lemma avg_const c : avg N (fun _ => c) = c.
Proof. unfold avg. rewrite sum_const. field. apply Rgt_not_eq, INR_N_pos. Qed.

Lemma Eu_ext M f g : (forall w, f w = g w) -> Eu N M f = Eu N M g.
Proof.
  revert f g. induction M as [|M IH]; intros f g H; simpl; [apply H|].
  apply IH. intros w. apply avg_ext. intros; apply H.
Qed.

Lemma Eu_mono M f g : (forall w, f w <= g w) -> Eu N M f <= Eu N M g.
Proof.
  revert f g. induction M as [|M IH]; intros f g H; simpl; [apply H|].
  apply IH. intros w. apply avg_le. intros; apply H.
Qed.

Lemma Eu_add M f g : Eu N M (fun w => f w + g w) = Eu N M f + Eu N M g.
Proof.
  revert f g. induction M as [|M IH]; intros f g; simpl; [reflexivity|].
  rewrite <- IH. apply Eu_ext. intros w. apply avg_add.
Qed.

Lemma Eu_scal M c f : Eu N M (fun w => c * f w) = c * Eu N M f.
Proof.
  revert f. induction M as [|M IH]; intros f; simpl; [reflexivity|].
  rewrite <- IH. apply Eu_ext. intros w. apply avg_scal.
Qed.

(** The finite average is a probability: E c = c, in particular E 1 = 1 (an abstract
    operator could satisfy E = 0; this one cannot). *)
Theorem Eu_const M c : Eu N M (fun _ => c) = c.
Proof.
  induction M as [|M IH]; simpl; [reflexivity|].
  rewrite (Eu_ext _ _ (fun _ => c)); [exact IH|]. intros; apply avg_const.
Qed.

Lemma Eu_nonneg M f : (forall w, 0 <= f w) -> 0 <= Eu N M f.
Proof. intros H. rewrite <- (Eu_const M 0). apply Eu_mono. exact H. Qed.

Lemma rprod_ext n f g : (forall i, (i < n)%nat -> f i = g i) -> rprod n f = rprod n g.
Proof.
  induction n as [|n IH]; intros H; simpl; [reflexivity|].
  rewrite IH, H by (intros; try apply H; lia). reflexivity.
Qed.

(** Independence, proved: on the product space the expectation of a product of functions
    of distinct coordinates is the product of their averages. *)
Theorem Eu_rprod M (f : nat -> nat -> R) :
  Eu N M (fun w => rprod M (fun k => f k (w k))) = rprod M (fun k => avg N (f k)).
Proof.
  induction M as [|M IH]; simpl; [reflexivity|].
  rewrite <- IH. rewrite <- Rmult_comm, <- Eu_scal. apply Eu_ext. intros w.
  rewrite Rmult_comm, <- avg_scal. apply avg_ext. intros i _. cbv beta.
  rewrite (rprod_ext M (fun k => f k (upd w M i k)) (fun k => f k (w k))).
  - unfold upd. rewrite Nat.eqb_refl. ring.
  - intros k Hk. unfold upd. replace (Nat.eqb k M) with false by (symmetry; apply Nat.eqb_neq; lia).
    reflexivity.
Qed.

End Space.

(** * The error of one coordinate on the grid *)

Lemma sum_shift1 n f : sum (S n) f = f O + sum n (fun i => f (S i)).
Proof.
  induction n as [|n IH]; simpl in *; [ring|].
  rewrite IH. ring.
Qed.

(** Cyclic rotation of the index set [0, N). *)
Lemma sum_rotate N c f : (0 < N)%nat -> sum N (fun i => f ((c + i) mod N)%nat) = sum N f.
Proof.
  intros HN. induction c as [|c IH].
  - apply sum_ext. intros i Hi. simpl. rewrite Nat.mod_small by lia. reflexivity.
  - rewrite <- IH.
    assert (H1 : sum (S N) (fun i => f ((c + i) mod N)%nat)
               = sum N (fun i => f ((c + i) mod N)%nat) + f (c mod N)).
    { rewrite sum_succ. f_equal. f_equal.
      replace (c + N)%nat with (c + 1 * N)%nat by lia. apply Nat.mod_add. lia. }
    rewrite sum_shift1 in H1. rewrite Nat.add_0_r in H1.
    rewrite (sum_ext N (fun i => f ((S c + i) mod N)%nat) (fun i => f ((c + S i) mod N)%nat))
      by (intros; f_equal; f_equal; lia).
    lra.
Qed.

(** A nondecreasing integer sequence that rises by at most one jumps once. *)
Lemma one_jump (m : nat -> Z) n :
  (forall i, (S i < n)%nat -> (m i <= m (S i))%Z) ->
  (forall i, (i < n)%nat -> (m i <= m O + 1)%Z) ->
  (0 < n)%nat ->
  exists c, (1 <= c <= n)%nat /\
    forall i, (i < n)%nat -> m i = (m O + if Nat.ltb i c then 0 else 1)%Z.
Proof.
  intros Hmono Hup. induction n as [|n IH]; intros Hn; [lia|].
  destruct n as [|n].
  - exists 1%nat. split; [lia|]. intros i Hi. replace i with O by lia. simpl. lia.
  - destruct IH as [c [Hc Hi]]; [intros; apply Hmono; lia|intros; apply Hup; lia|lia|].
    assert (Hmono' : forall i j, (j < S (S n))%nat -> (i <= j)%nat -> (m i <= m j)%Z).
    { intros i j Hj Hij. induction Hij; [lia|].
      apply Z.le_trans with (m m0); [apply IHHij; lia|apply Hmono; lia]. }
    assert (Hlast : (m O <= m (S n) <= m O + 1)%Z) by (split; [apply Hmono'; lia|apply Hup; lia]).
    destruct (Nat.lt_ge_cases c (S n)) as [Hlt|Hge].
    + exists c. split; [lia|]. intros i Hin.
      destruct (Nat.eq_dec i (S n)) as [->|Hne]; [|apply Hi; lia].
      replace (Nat.ltb (S n) c) with false by (symmetry; apply Nat.ltb_ge; lia).
      assert (Hc' := Hi c Hlt). replace (Nat.ltb c c) with false in Hc' by (symmetry; apply Nat.ltb_ge; lia).
      assert (m c <= m (S n))%Z by (apply Hmono'; lia). lia.
    + destruct (Z.eq_dec (m (S n)) (m O)) as [Heq|Hne].
      * exists (S (S n)). split; [lia|]. intros i Hin.
        replace (Nat.ltb i (S (S n))) with true by (symmetry; apply Nat.ltb_lt; lia).
        destruct (Nat.eq_dec i (S n)) as [->|Hne']; [lia|].
        rewrite (Hi i) by lia. replace (Nat.ltb i c) with true by (symmetry; apply Nat.ltb_lt; lia). lia.
      * exists (S n). split; [lia|]. intros i Hin.
        destruct (Nat.eq_dec i (S n)) as [->|Hne'].
        -- rewrite Nat.ltb_irrefl. lia.
        -- rewrite (Hi i) by lia. replace (Nat.ltb i c) with true by (symmetry; apply Nat.ltb_lt; lia).
           replace (Nat.ltb i (S n)) with true by (symmetry; apply Nat.ltb_lt; lia). lia.
Qed.

(** * The symmetric grid is sub-Gaussian with proxy its variance *)

Lemma fact_even_ge k : (2 ^ k * fact k <= fact (2 * k))%nat.
Proof.
  induction k as [|k IH]; [simpl; lia|].
  replace (2 * S k)%nat with (S (S (2 * k))) by lia.
  change (fact (S (S (2 * k)))) with (S (S (2 * k)) * (S (2 * k) * fact (2 * k)))%nat.
  change (fact (S k)) with (S k * fact k)%nat. rewrite Nat.pow_succ_r'. nia.
Qed.

Lemma exp_partial_even x N :
  exp_partial x (2 * N + 1) + exp_partial (- x) (2 * N + 1)
  = 2 * sum_f_R0 (fun k => / INR (fact (2 * k)) * x ^ (2 * k)) N.
Proof.
  unfold exp_partial. induction N as [|N IH]; [simpl; field|].
  replace (2 * S N + 1)%nat with (S (S (2 * N + 1))) by lia.
  rewrite !tech5.
  replace (S (2 * N + 1)) with (2 * S N)%nat by lia.
  replace (S (2 * S N)) with (2 * S N + 1)%nat by lia.
  rewrite pow_opp_even, pow_opp_odd.
  transitivity (sum_f_R0 (fun i => / INR (fact i) * x ^ i) (2 * N + 1)
    + sum_f_R0 (fun i => / INR (fact i) * (- x) ^ i) (2 * N + 1)
    + 2 * (/ INR (fact (2 * S N)) * x ^ (2 * S N))); [ring|].
  rewrite IH. ring.
Qed.

Lemma even_term_le x k :
  / INR (fact (2 * k)) * x ^ (2 * k) <= / INR (fact k) * (x ^ 2 / 2) ^ k.
Proof.
  assert (Hf : 0 < INR (fact k)) by apply lt_0_INR, lt_O_fact.
  assert (H2 : 0 < 2 ^ k) by (apply pow_lt; lra).
  assert (Hle : 2 ^ k * INR (fact k) <= INR (fact (2 * k))).
  { replace 2 with (INR 2) by (simpl; ring). rewrite <- pow_INR, <- mult_INR.
    apply le_INR, fact_even_ge. }
  assert (Hx : 0 <= x ^ (2 * k)) by (rewrite pow_mult; apply pow_le; nra).
  replace (/ INR (fact k) * (x ^ 2 / 2) ^ k) with (/ (2 ^ k * INR (fact k)) * x ^ (2 * k)).
  - apply Rmult_le_compat_r; [exact Hx|].
    apply Rinv_le_contravar; [apply Rmult_lt_0_compat; lra|exact Hle].
  - unfold Rdiv. rewrite Rpow_mult_distr, pow_inv, pow_mult. field. lra.
Qed.

(** cosh x <= exp(x^2/2): a random sign is sub-Gaussian with proxy 1. *)
Lemma cosh_le_exp_sq x : (exp x + exp (- x)) / 2 <= exp (x ^ 2 / 2).
Proof.
  assert (Hcv : Un_cv (fun N => exp_partial x (2 * N + 1) + exp_partial (- x) (2 * N + 1))
                      (exp x + exp (- x))).
  { apply CV_plus; apply cv_odd_subseq, exp_partial_cv. }
  assert (Hb : exp x + exp (- x) <= 2 * exp (x ^ 2 / 2)).
  { eapply Rle_cv_lim; [|exact Hcv|apply (cv_const (2 * exp (x ^ 2 / 2)))].
    intros N. cbv beta. rewrite exp_partial_even. apply Rmult_le_compat_l; [lra|].
    apply Rle_trans with (exp_partial (x ^ 2 / 2) N).
    - apply sum_Rle. intros k _. apply even_term_le.
    - apply exp_partial_le. apply Rmult_le_pos; [apply pow2_ge_0|lra]. }
  lra.
Qed.

(** Sg N t: the moment generating function, times N, of the symmetric N-point grid with unit
    spacing. *)
Definition Sg (N : nat) (t : R) : R := sum N (fun r => exp (t * (INR r - (INR N - 1) / 2))).

Lemma Sg_double N t :
  Sg (2 * N) t = (exp (t * INR N / 2) + exp (- (t * INR N / 2))) * Sg N t.
Proof.
  unfold Sg. replace (2 * N)%nat with (N + N)%nat by lia. rewrite sum_split.
  rewrite Rmult_plus_distr_r, <- !sum_scal_l, Rplus_comm. f_equal; apply sum_ext; intros r _;
    rewrite <- exp_plus; f_equal; rewrite ?plus_INR; field.
Qed.

Lemma Sg_nonneg N t : 0 <= Sg N t.
Proof. apply sum_nonneg. intros; left; apply exp_pos. Qed.

(** The symmetric grid of N = 2^K points is sub-Gaussian with proxy its variance (N^2-1)/12. *)
Lemma Sg_pow2_le K t : Sg (2 ^ K) t <= INR (2 ^ K) * exp (t ^ 2 * (INR (2 ^ K) ^ 2 - 1) / 24).
Proof.
  induction K as [|K IH].
  - unfold Sg. simpl.
    replace (t * (0 - (1 - 1) / 2)) with 0 by field.
    replace (t * (t * 1) * (1 * (1 * 1) - 1) / 24) with 0 by field. rewrite exp_0. lra.
  - rewrite Nat.pow_succ_r', Sg_double.
    set (n := INR (2 ^ K)) in *.
    assert (Hc := cosh_le_exp_sq (t * n / 2)).
    apply Rle_trans with ((2 * exp ((t * n / 2) ^ 2 / 2)) * (n * exp (t ^ 2 * (n ^ 2 - 1) / 24))).
    + apply Rmult_le_compat; [|apply Sg_nonneg|lra|exact IH].
      left. apply Rplus_lt_0_compat; apply exp_pos.
    + rewrite mult_INR. fold n. simpl INR.
      replace (2 * exp ((t * n / 2) ^ 2 / 2) * (n * exp (t ^ 2 * (n ^ 2 - 1) / 24)))
        with ((1 + 1) * n * (exp ((t * n / 2) ^ 2 / 2) * exp (t ^ 2 * (n ^ 2 - 1) / 24))) by ring.
      rewrite <- exp_plus. right. f_equal. f_equal. field.
Qed.

(** The dither grid of fast/quant.py for N = 2^16: u_i = (2 i + 1 - N) / (2 N), i < N. *)
Definition grid_u (N i : nat) : R := (2 * INR i + 1 - INR N) / (2 * INR N).

(** The error, in steps, of one subtractively dithered coordinate: the code is m = R(y + u)
    for the scaled input y, the dequantized value is m - u, the error (m - u) - y. *)
Definition grid_err (N : nat) (rnd : R -> Z) (y : R) (i : nat) : R :=
  IZR (rnd (y + grid_u N i)) - (y + grid_u N i).

Lemma Rabs_le_inv x a : Rabs x <= a -> - a <= x <= a.
Proof. unfold Rabs. destruct (Rcase_abs x); intros; lra. Qed.

Lemma sum_INR_id n : sum n (fun r => INR r) = INR n * (INR n - 1) / 2.
Proof.
  induction n as [|n IH]; simpl sum; [simpl; field|].
  rewrite IH, S_INR. field.
Qed.

Lemma grid_u_le N i j : (0 < N)%nat -> (i <= j)%nat -> grid_u N i <= grid_u N j.
Proof.
  intros HN Hij. unfold grid_u, Rdiv. apply Rmult_le_compat_r.
  - left. apply Rinv_0_lt_compat. assert (0 < INR N) by (apply lt_0_INR; lia). lra.
  - apply le_INR in Hij. lra.
Qed.

Section Grid.
Variable N : nat.
Hypothesis HN : (0 < N)%nat.
Variable rnd : R -> Z.
Hypothesis R_mono : forall a b, a <= b -> (rnd a <= rnd b)%Z.
Variables (eta y : R).
Hypothesis eta_lt : 2 * eta < / INR N.
Hypothesis R_close : forall i, (i < N)%nat -> Rabs (grid_err N rnd y i) <= / 2 + eta.

Let m i := rnd (y + grid_u N i).


Lemma grid_err_shape :
  exists mu0 c, (c <= N)%nat /\ Rabs mu0 <= / (2 * INR N) + eta /\
    forall i, (i < N)%nat ->
      grid_err N rnd y i = mu0 + ((INR N - 1) / 2 - INR ((N - c + i) mod N)) / INR N.
Proof.
  assert (HNr : 0 < INR N) by (apply lt_0_INR; lia).
  assert (Hmono : forall i, (S i < N)%nat -> (m i <= m (S i))%Z).
  { intros i Hi. apply R_mono. apply Rplus_le_compat_l, grid_u_le; lia. }
  assert (Hup : forall i, (i < N)%nat -> (m i <= m O + 1)%Z).
  { intros i Hi. apply Z.lt_succ_r. apply lt_IZR. rewrite succ_IZR, plus_IZR.
    assert (H1 := R_close i Hi). assert (H0 := R_close O HN).
    unfold grid_err in H1, H0. fold (m i) in H1. fold (m O) in H0.
    apply Rabs_le_inv in H1. apply Rabs_le_inv in H0.
    assert (Hu : grid_u N i - grid_u N O <= (INR N - 1) / INR N).
    { replace (grid_u N i - grid_u N O) with (INR i / INR N) by (unfold grid_u; simpl INR; field; lra).
      assert (INR i + 1 <= INR N) by (rewrite <- S_INR; apply le_INR; lia).
      unfold Rdiv. apply Rmult_le_compat_r; [left; apply Rinv_0_lt_compat; lra|lra]. }
    assert (Hinv : (INR N - 1) / INR N + / INR N = 1) by (field; lra).
    lra. }
  destruct (one_jump m N Hmono Hup HN) as [c [Hc Hm]].
  set (mu0 := IZR (m O) - y + 1 - INR c / INR N).
  assert (Hform : forall i, (i < N)%nat ->
      grid_err N rnd y i = mu0 + ((INR N - 1) / 2 - INR ((N - c + i) mod N)) / INR N).
  { intros i Hi. unfold grid_err. fold (m i). rewrite (Hm i Hi). unfold mu0, grid_u.
    destruct (Nat.ltb_spec i c) as [Hic|Hic].
    - rewrite Nat.mod_small by lia. rewrite plus_IZR, !plus_INR, minus_INR by lia.
      simpl IZR. field. lra.
    - replace (N - c + i)%nat with ((i - c) + 1 * N)%nat by lia.
      rewrite Nat.mod_add, Nat.mod_small by lia. rewrite plus_IZR, minus_INR by lia.
      simpl IZR. field. lra. }
  exists mu0, c. split; [lia|]. split; [|exact Hform].
  apply Rabs_le. split.
  - assert (H := R_close (c - 1) ltac:(lia)). apply Rabs_le_inv in H.
    rewrite Hform in H by lia.
    replace ((N - c + (c - 1)) mod N)%nat with (N - 1)%nat in H
      by (rewrite Nat.mod_small by lia; lia).
    rewrite minus_INR in H by lia. simpl INR in H.
    assert (Hx : mu0 + ((INR N - 1) / 2 - (INR N - 1)) / INR N = mu0 - / 2 + / (2 * INR N))
      by (field; lra).
    rewrite Hx in H. lra.
  - destruct (Nat.eq_dec c N) as [Hce|Hce].
    + assert (H := R_close O HN). apply Rabs_le_inv in H. rewrite Hform in H by lia.
      replace ((N - c + 0) mod N)%nat with O in H by (rewrite Hce, Nat.sub_diag, Nat.add_0_r, Nat.mod_0_l by lia; reflexivity).
      assert (Hx : mu0 + ((INR N - 1) / 2 - INR 0) / INR N = mu0 + / 2 - / (2 * INR N))
        by (simpl; field; lra).
      rewrite Hx in H. lra.
    + assert (H := R_close c ltac:(lia)). apply Rabs_le_inv in H. rewrite Hform in H by lia.
      replace ((N - c + c) mod N)%nat with O in H
        by (replace (N - c + c)%nat with (0 + 1 * N)%nat by lia; rewrite Nat.mod_add, Nat.mod_0_l by lia; reflexivity).
      assert (Hx : mu0 + ((INR N - 1) / 2 - INR 0) / INR N = mu0 + / 2 - / (2 * INR N))
        by (simpl; field; lra).
      rewrite Hx in H. lra.
Qed.

(** The errors over the grid are a rotation of the symmetric grid, shifted by their mean. *)
Lemma grid_err_sum_eq (F : R -> R) :
  sum N (fun i => F (grid_err N rnd y i))
  = sum N (fun r => F (avg N (grid_err N rnd y) + ((INR N - 1) / 2 - INR r) / INR N)).
Proof.
  assert (HNr : 0 < INR N) by (apply lt_0_INR; lia).
  destruct grid_err_shape as [mu0 [c [Hc [_ Hf]]]].
  assert (Hmu : avg N (grid_err N rnd y) = mu0).
  { unfold avg. rewrite (sum_ext _ _ _ Hf).
    rewrite (sum_rotate N (N - c) (fun r => mu0 + ((INR N - 1) / 2 - INR r) / INR N)) by lia.
    rewrite sum_add, sum_const. unfold Rdiv at 2.
    rewrite (sum_ext N (fun r => ((INR N - 1) / 2 - INR r) * / INR N)
                       (fun r => / INR N * ((INR N - 1) / 2) - / INR N * INR r))
      by (intros; ring).
    rewrite sum_sub, sum_const, sum_scal_l, sum_INR_id. field. lra. }
  rewrite Hmu. rewrite (sum_ext _ _ _ (fun i Hi => f_equal F (Hf i Hi))).
  apply (sum_rotate N (N - c) (fun r => F (mu0 + ((INR N - 1) / 2 - INR r) / INR N))). lia.
Qed.

(** The mean error of one dithered coordinate over the grid: within 1/(2N) + eta steps. *)
Theorem abs_grid_err_mean_le : Rabs (avg N (grid_err N rnd y)) <= / (2 * INR N) + eta.
Proof.
  assert (HNr : 0 < INR N) by (apply lt_0_INR; lia).
  destruct grid_err_shape as [mu0 [c [Hc [Hb Hf]]]].
  replace (avg N (grid_err N rnd y)) with mu0; [exact Hb|].
  assert (H := grid_err_sum_eq (fun z => z)). cbv beta in H.
  unfold avg at 1. rewrite (sum_ext _ _ _ Hf).
  rewrite (sum_rotate N (N - c) (fun r => mu0 + ((INR N - 1) / 2 - INR r) / INR N)) by lia.
  rewrite sum_add, sum_const. unfold Rdiv at 2.
  rewrite (sum_ext N (fun r => ((INR N - 1) / 2 - INR r) * / INR N)
                     (fun r => / INR N * ((INR N - 1) / 2) - / INR N * INR r))
    by (intros; ring).
  rewrite sum_sub, sum_const, sum_scal_l, sum_INR_id. field. lra.
Qed.



Variable K : nat.
Hypothesis HNK : N = (2 ^ K)%nat.

(** The centred error of one dithered coordinate is sub-Gaussian with proxy (1 - 1/N^2)/12. *)
Theorem grid_err_mgf_le a :
  avg N (fun i => exp (a * (grid_err N rnd y i - avg N (grid_err N rnd y))))
  <= exp (a ^ 2 * (1 - / INR N ^ 2) / 24).
Proof.
  assert (HNr : 0 < INR N) by (apply lt_0_INR; lia).
  set (mu := avg N (grid_err N rnd y)).
  unfold avg at 1. rewrite (grid_err_sum_eq (fun z => exp (a * (z - mu)))). fold mu.
  rewrite (sum_ext N _ (fun r => exp ((- a / INR N) * (INR r - (INR N - 1) / 2))))
    by (intros; f_equal; field; lra).
  change (sum N (fun r => exp ((- a / INR N) * (INR r - (INR N - 1) / 2)))) with (Sg N (- a / INR N)).
  assert (H := Sg_pow2_le K (- a / INR N)). rewrite <- HNK in H.
  unfold Rdiv at 1. apply Rle_trans with (INR N * exp ((- a / INR N) ^ 2 * (INR N ^ 2 - 1) / 24) * / INR N).
  - apply Rmult_le_compat_r; [left; apply Rinv_0_lt_compat; lra|exact H].
  - right. field_simplify; [|lra]. f_equal. field. lra.
Qed.

End Grid.

(** * Weighted sums of dithered coordinates: tail, union, request *)

Definition lin_err (N : nat) (rnd : R -> Z) (ys : nat -> R) (M : nat) (b : nat -> R)
  (w : nat -> nat) : R :=
  sum M (fun k => b k * grid_err N rnd (ys k) (w k)).

Definition bias_bound (N : nat) (eta : R) (M : nat) (b : nat -> R) : R :=
  sum M (fun k => Rabs (b k)) * (/ (2 * INR N) + eta).

Definition proxy (M : nat) (b : nat -> R) : R := sum M (fun k => b k ^ 2) / 12.

Definition viol (X : (nat -> nat) -> R) (c : R) (w : nat -> nat) : R :=
  if Rlt_dec c (Rabs (X w)) then 1 else 0.

Fixpoint any_ind (n : nat) (f : nat -> (nat -> nat) -> R) (w : nat -> nat) : R :=
  match n with
  | O => 0
  | S m => Rmax (any_ind m f w) (f m w)
  end.

Lemma viol_nonneg X c w : 0 <= viol X c w.
Proof. unfold viol. destruct (Rlt_dec _ _); lra. Qed.

Lemma any_ind_nonneg n f w : 0 <= any_ind n f w.
Proof.
  induction n as [|n IH]; simpl; [lra|]. apply Rle_trans with (any_ind n f w); [exact IH|apply Rmax_l].
Qed.

Lemma any_ind_le_sum n f w : (forall j w, 0 <= f j w) -> any_ind n f w <= sum n (fun j => f j w).
Proof.
  intros Hf. induction n as [|n IH]; simpl; [lra|].
  apply Rmax_lub; [assert (H := Hf n w); lra|].
  assert (H := sum_nonneg n (fun j => f j w) (fun j _ => Hf j w)). lra.
Qed.

Lemma Eu_sum N M n (f : nat -> (nat -> nat) -> R) :
  (0 < N)%nat -> Eu N M (fun w => sum n (fun j => f j w)) = sum n (fun j => Eu N M (f j)).
Proof.
  intros HN. induction n as [|n IH]; simpl.
  - apply Eu_const. exact HN.
  - rewrite Eu_add by exact HN. rewrite IH. reflexivity.
Qed.

(** Union bound: the probability that some event of a finite family occurs is at most the
    sum of their probabilities. *)
Lemma Eu_any_le N M n f :
  (0 < N)%nat -> (forall j w, 0 <= f j w) ->
  Eu N M (any_ind n f) <= sum n (fun j => Eu N M (f j)).
Proof.
  intros HN Hf. rewrite <- Eu_sum by exact HN. apply Eu_mono; [exact HN|].
  intros w. apply any_ind_le_sum. exact Hf.
Qed.

Lemma exp_mono a b : a <= b -> exp a <= exp b.
Proof. intros [H|H]; [left; apply exp_increasing; exact H|right; rewrite H; reflexivity]. Qed.

Section Read.
Variables (N K : nat).
Hypothesis HNK : N = (2 ^ K)%nat.
Variable rnd : R -> Z.
Hypothesis R_mono : forall a b, a <= b -> (rnd a <= rnd b)%Z.
Variable eta : R.
Hypothesis eta_nonneg : 0 <= eta.
Hypothesis eta_lt : 2 * eta < / INR N.
Variables (M : nat) (ys : nat -> R).
Hypothesis R_close : forall k i, (k < M)%nat -> (i < N)%nat -> Rabs (grid_err N rnd (ys k) i) <= / 2 + eta.

Lemma HN : (0 < N)%nat.
Proof. rewrite HNK. apply Nat.neq_0_lt_0, Nat.pow_nonzero. lia. Qed.

Let mu k := avg N (grid_err N rnd (ys k)).

Lemma abs_bias_le b : Rabs (sum M (fun k => b k * mu k)) <= bias_bound N eta M b.
Proof.
  unfold bias_bound. rewrite <- sum_scal_r.
  apply Rle_trans with (sum M (fun k => Rabs (b k * mu k))); [apply sum_abs_le|].
  apply sum_le. intros k Hk. rewrite Rabs_mult. apply Rmult_le_compat_l; [apply Rabs_pos|].
  apply (abs_grid_err_mean_le N HN rnd R_mono eta (ys k) eta_lt). intros; apply R_close; assumption.
Qed.

Lemma centred_mgf_le b lambda :
  Eu N M (fun w => exp (lambda * (lin_err N rnd ys M b w - sum M (fun k => b k * mu k))))
  <= exp (lambda ^ 2 * proxy M b / 2).
Proof.
  assert (HNr : 0 < INR N) by (apply lt_0_INR, HN).
  pose (f := fun k i => exp (lambda * (b k * (grid_err N rnd (ys k) i - mu k)))).
  rewrite (Eu_ext N M _ (fun w => rprod M (fun k => f k (w k)))).
  2:{ intros w. unfold f. rewrite <- exp_sum_eq_rprod. f_equal. unfold lin_err. rewrite <- sum_sub, <- sum_scal_l.
      apply sum_ext. intros; cbv beta. ring. }
  rewrite (Eu_rprod N HN M f). unfold f.
  apply Rle_trans with (rprod M (fun k => exp ((lambda * b k) ^ 2 * (1 - / INR N ^ 2) / 24))).
  - apply rprod_le. intros k Hk. split; [apply Rlt_le, Rmult_lt_0_compat; [|apply Rinv_0_lt_compat; exact HNr]|].
    + apply sum_pos; [apply HN|]. intros; apply exp_pos.
    + rewrite (avg_ext N _ (fun i => exp ((lambda * b k) * (grid_err N rnd (ys k) i - mu k))))
        by (intros; f_equal; ring).
      apply (grid_err_mgf_le N HN rnd R_mono eta (ys k) eta_lt (fun i Hi => R_close k i Hk Hi) K HNK).
  - rewrite <- exp_sum_eq_rprod. apply exp_mono. unfold proxy.
    rewrite (sum_ext M _ (fun k => (lambda ^ 2 * (1 - / INR N ^ 2) / 24) * b k ^ 2)) by (intros; field; lra).
    rewrite sum_scal_l.
    assert (0 <= sum M (fun k => b k ^ 2)) by (apply sum_nonneg; intros; apply pow2_ge_0).
    assert (0 <= / INR N ^ 2) by (left; apply Rinv_0_lt_compat, pow_lt, HNr).
    assert (0 <= lambda ^ 2) by apply pow2_ge_0.
    assert (Hp : 0 <= lambda ^ 2 * sum M (fun k => b k ^ 2) * / INR N ^ 2) by (apply Rmult_le_pos; [apply Rmult_le_pos|]; assumption).
    nra.
Qed.

(** The per-token tail on the grid: the logit error of one token, a fixed linear form in the
    dithered coordinates (possibly perturbed by at most rho), exceeds its radius
    bias + rho + sigma sqrt(2 ln(2n/d)) with probability at most d/n. *)
Theorem token_failure_le (b : nat -> R) (Xr : (nat -> nat) -> R) (rho : R) (n : nat) (d : R) :
  (0 < n)%nat -> 0 < d -> d <= 2 * INR n ->
  (forall w, Rabs (Xr w - lin_err N rnd ys M b w) <= rho) ->
  Eu N M (viol Xr (bias_bound N eta M b + rho + sqrt (proxy M b) * sqrt (2 * ln (2 * INR n / d))))
  <= d / INR n.
Proof.
  intros Hn Hd Hdn Hrho.
  assert (HNr : 0 < INR N) by (apply lt_0_INR, HN).
  assert (Hnr : 0 < INR n) by (apply lt_0_INR; lia).
  assert (Hq : 1 <= 2 * INR n / d).
  { apply (Rmult_le_reg_r d); [lra|]. unfold Rdiv. rewrite Rmult_assoc, Rinv_l; lra. }
  assert (Hf : 0 <= sqrt (2 * ln (2 * INR n / d))) by apply sqrt_pos.
  assert (Hbb : 0 <= bias_bound N eta M b).
  { unfold bias_bound. apply Rmult_le_pos; [apply sum_nonneg; intros; apply Rabs_pos|].
    assert (0 < / (2 * INR N)) by (apply Rinv_0_lt_compat; lra). lra. }
  set (bias := sum M (fun k => b k * mu k)).
  assert (Hbias := abs_bias_le b). fold bias in Hbias.
  assert (Hdn' : 0 < d / INR n) by (apply Rdiv_lt_0_compat; lra).
  assert (Hp0 : 0 <= proxy M b) by (unfold proxy; apply Rmult_le_pos; [apply sum_nonneg; intros; apply pow2_ge_0|lra]).
  destruct (Req_dec (proxy M b) 0) as [Hz|Hz].
  - (* no randomness reaches this token: the error is within bias + rho surely *)
    rewrite (Eu_ext N M _ (fun _ => 0)); [rewrite Eu_const by apply HN; lra|].
    intros w. unfold viol. destruct (Rlt_dec _ _) as [Hlt|]; [exfalso|reflexivity].
    assert (Hb0 : forall k, (k < M)%nat -> b k = 0).
    { intros k Hk. unfold proxy in Hz.
      assert (Hs : sum M (fun k => b k ^ 2) = 0) by lra.
      assert (Hk0 := sum_nonneg_eq_0 M (fun k => b k ^ 2) (fun j _ => pow2_ge_0 (b j)) Hs k Hk).
      cbv beta in Hk0. nra. }
    assert (Hx : lin_err N rnd ys M b w = 0).
    { unfold lin_err. rewrite (sum_ext M _ (fun _ => 0)) by (intros k Hk; rewrite Hb0 by exact Hk; ring).
      rewrite sum_const. ring. }
    assert (H := Hrho w). rewrite Hx, Rminus_0_r in H. rewrite Hz, sqrt_0 in Hlt. nra.
  - assert (Hv : 0 < proxy M b) by lra.
    set (c := sqrt (proxy M b) * sqrt (2 * ln (2 * INR n / d))).
    assert (Hc : 0 <= c) by (apply Rmult_le_pos; [apply sqrt_pos|exact Hf]).
    apply Rle_trans with (Eu N M (ind_ge (nat -> nat)
      (fun w => Rabs (lin_err N rnd ys M b w - bias)) c)).
    + apply Eu_mono; [apply HN|]. intros w. unfold viol, ind_ge.
      destruct (Rlt_dec _ _) as [Hlt|]; destruct (Rle_dec _ _) as [|Hn']; try lra.
      exfalso. apply Hn'. assert (H := Hrho w).
      assert (H1 := Rabs_triang (Xr w - lin_err N rnd ys M b w) (lin_err N rnd ys M b w - bias)).
      assert (H2 := Rabs_triang (Xr w - bias) bias).
      replace (Xr w - lin_err N rnd ys M b w + (lin_err N rnd ys M b w - bias)) with (Xr w - bias) in H1 by ring.
      replace (Xr w - bias + bias) with (Xr w) in H2 by ring. lra.
    + apply Rle_trans with (2 * exp (- c ^ 2 / (2 * proxy M b))).
      * apply (tail_le_of_mgf_le (nat -> nat) (Eu N M)).
        -- intros; apply Eu_mono; [apply HN|assumption].
        -- intros; apply Eu_add; apply HN.
        -- intros; apply Eu_scal; apply HN.
        -- exact Hv.
        -- exact Hc.
        -- intros lambda. apply centred_mgf_le.
      * assert (Hu := union_bound_eq_of_radius n d (sqrt (proxy M b)) c Hn Hd Hdn
                         (sqrt_lt_R0 _ Hv) eq_refl).
        rewrite pow2_sqrt in Hu by lra.
        right. apply (Rmult_eq_reg_l (INR n)); [|lra]. rewrite Hu. field. lra.
Qed.


(** The request-level failure bound on the grid: for any number of steps T, L layers, H
    heads and n_t tokens read at step t, with local budgets delta_req / (L H t (t+1)), the
    probability that some certificate of the request is violated is at most delta_req.
    Every logit error Xr is within rho of a fixed linear form in the dithered coordinates
    (coefficients s q_i delta_i, fixed in advance: A2); the dither is the uniform product
    space on the grid (A1). *)
Theorem request_failure_le_of_grid (L H T : nat) (delta_req : R) (n : nat -> nat)
  (b : nat -> nat -> nat -> nat -> nat -> R)
  (Xr : nat -> nat -> nat -> nat -> (nat -> nat) -> R)
  (rho : nat -> nat -> nat -> nat -> R) :
  (0 < L)%nat -> (0 < H)%nat -> 0 < delta_req <= 1 -> (forall t, (0 < n t)%nat) ->
  (forall l h t j w, Rabs (Xr l h t j w - lin_err N rnd ys M (b l h t j) w) <= rho l h t j) ->
  Eu N M (any_ind T (fun i => any_ind L (fun l => any_ind H (fun h =>
    any_ind (n (S i)) (fun j =>
      viol (Xr l h (S i) j)
        (bias_bound N eta M (b l h (S i) j) + rho l h (S i) j
         + sqrt (proxy M (b l h (S i) j))
           * sqrt (2 * ln (2 * INR (n (S i))
                    / (delta_req / (INR L * INR H * INR (S i) * (INR (S i) + 1)))))))))))
  <= delta_req.
Proof.
  intros HL HH Hdel Hn Hrho.
  assert (HL' : 1 <= INR L) by (apply (le_INR 1); lia).
  assert (HH' : 1 <= INR H) by (apply (le_INR 1); lia).
  eapply Rle_trans; [apply Eu_any_le; [apply HN|intros; apply any_ind_nonneg]|].
  eapply Rle_trans; [|apply (request_failure_le_of_budget L H T delta_req HL HH); lra].
  apply sum_le. intros i Hi.
  set (di := delta_req / (INR L * INR H * INR (S i) * (INR (S i) + 1))).
  assert (Ht : 1 <= INR (S i)) by (apply (le_INR 1); lia).
  assert (Hden : 1 <= INR L * INR H * INR (S i) * (INR (S i) + 1)).
  { assert (1 <= INR L * INR H) by nra. assert (1 <= INR L * INR H * INR (S i)) by nra. nra. }
  assert (Hdi : 0 < di) by (apply Rdiv_lt_0_compat; lra).
  assert (Hdi1 : di <= delta_req).
  { unfold di. apply (Rmult_le_reg_r (INR L * INR H * INR (S i) * (INR (S i) + 1))); [lra|].
    unfold Rdiv. rewrite Rmult_assoc, Rinv_l by lra. nra. }
  assert (Hni : 1 <= INR (n (S i))) by (apply (le_INR 1), Hn).
  eapply Rle_trans; [apply Eu_any_le; [apply HN|intros; apply any_ind_nonneg]|].
  apply Rle_trans with (sum L (fun _ => sum H (fun _ => di))).
  - apply sum_le. intros l Hl.
    eapply Rle_trans; [apply Eu_any_le; [apply HN|intros; apply any_ind_nonneg]|].
    apply sum_le. intros h Hh.
    eapply Rle_trans; [apply Eu_any_le; [apply HN|intros; apply viol_nonneg]|].
    apply Rle_trans with (sum (n (S i)) (fun _ => di / INR (n (S i)))).
    + apply sum_le. intros j Hj. apply token_failure_le; [apply Hn|exact Hdi|lra|apply Hrho].
    + right. rewrite sum_const. field. lra.
  - right. rewrite !sum_const, mult_INR. ring.
Qed.

End Read.
