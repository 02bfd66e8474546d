(** T7: eviction. Tokens 0..n-1 with logits [x]; [kept j = true] marks the kept set K,
    the others form the evicted set E. [p^K] is the softmax over K only. *)
From KVCert Require Import Prelim Band Softmax.
From Coq Require Import Reals Lra Lia List.
Open Scope R_scope.

(** Partition functions of the kept and of the evicted tokens. *)
Definition z_kept (n : nat) (kept : nat -> bool) (x : nat -> R) : R :=
  sum n (fun j => if kept j then exp (x j) else 0).

Definition z_evicted (n : nat) (kept : nat -> bool) (x : nat -> R) : R :=
  sum n (fun j => if kept j then 0 else exp (x j)).

(** Softmax restricted to the kept tokens (zero on evicted ones). *)
Definition softmax_kept (n : nat) (kept : nat -> bool) (x : nat -> R) (j : nat) : R :=
  if kept j then exp (x j) / z_kept n kept x else 0.

(** Number of evicted tokens among 0..n-1 assigned to group [g]. *)
Fixpoint group_count (n : nat) (kept : nat -> bool) (group : nat -> nat) (g : nat) : nat :=
  match n with
  | O => O
  | S m => (group_count m kept group g
            + (if kept m then 0 else if Nat.eqb (group m) g then 1 else 0))%nat
  end.

Lemma z_evicted_nonneg n kept x : 0 <= z_evicted n kept x.
Proof.
  apply sum_nonneg. intros j _. destruct (kept j); [lra|]. left. apply exp_pos.
Qed.

Lemma sum_exp_eq_z_kept_add_z_evicted n kept x :
  sum n (fun i => exp (x i)) = z_kept n kept x + z_evicted n kept x.
Proof.
  unfold z_kept, z_evicted. rewrite <- sum_add. apply sum_ext.
  intros j _. destruct (kept j); ring.
Qed.

Lemma INR_group_count n kept group g :
  INR (group_count n kept group g)
  = sum n (fun j => if kept j then 0 else if Nat.eqb (group j) g then 1 else 0).
Proof.
  induction n as [|n IH]; simpl group_count; simpl sum; [reflexivity|].
  rewrite plus_INR, IH. destruct (kept n); [simpl; ring|].
  destruct (Nat.eqb (group n) g); simpl; ring.
Qed.

(** ** T7a *)

(** Evicting tokens moves the attention distribution by exactly the evicted mass, so
    bounding [Z_E] against [Z_K] bounds the whole eviction error. *)
Theorem evict_tv_eq_mass n kept x :
  0 < z_kept n kept x ->
  tv n (softmax n x) (softmax_kept n kept x)
  = z_evicted n kept x / (z_kept n kept x + z_evicted n kept x).
Proof.
  intros HK.
  assert (HE := z_evicted_nonneg n kept x).
  set (ZK := z_kept n kept x) in *. set (ZE := z_evicted n kept x) in *.
  unfold tv, softmax, softmax_kept.
  rewrite (sum_exp_eq_z_kept_add_z_evicted n kept x). fold ZK ZE.
  rewrite (sum_ext _ _ (fun j => (if kept j then exp (x j) else 0) * (ZE / ((ZK + ZE) * ZK))
                                 + (if kept j then 0 else exp (x j)) * / (ZK + ZE))).
  - rewrite sum_add, !sum_scal_r. fold (z_kept n kept x) (z_evicted n kept x). fold ZK ZE.
    field. lra.
  - intros j _. assert (Hx := exp_pos (x j)). destruct (kept j).
    + replace (exp (x j) / (ZK + ZE) - exp (x j) / ZK)
        with (- (exp (x j) * (ZE / ((ZK + ZE) * ZK)))) by (field; lra).
      rewrite Rabs_Ropp, Rabs_right; [ring|].
      apply Rle_ge, Rmult_le_pos; [lra|].
      apply Rmult_le_pos; [exact HE|]. left. apply Rinv_0_lt_compat. nra.
    + rewrite Rminus_0_r, Rabs_right; [unfold Rdiv; ring|].
      apply Rle_ge, Rmult_le_pos; [lra|]. left. apply Rinv_0_lt_compat. lra.
Qed.

(** ** T7b *)

(** Any upper bound on the evicted mass and lower bound on the kept mass give a
    certified bound, so cheap one-sided estimates of [Z_E] and [Z_K] suffice. *)
Theorem evict_tv_le_of_bounds ZK ZE L U :
  0 <= ZE -> ZE <= U -> 0 < L -> L <= ZK ->
  ZE / (ZK + ZE) <= U / (L + U).
Proof.
  intros HE HU HL HK.
  apply (Rmult_le_reg_r ((ZK + ZE) * (L + U))); [nra|].
  replace (ZE / (ZK + ZE) * ((ZK + ZE) * (L + U))) with (ZE * (L + U)) by (field; lra).
  replace (U / (L + U) * ((ZK + ZE) * (L + U))) with (U * (ZK + ZE)) by (field; lra).
  nra.
Qed.

(** The eviction TV itself is certified by any upper bound U on [Z_E] and lower bound L > 0
    on [Z_K]: TV(p, p^K) <= U/(L+U). *)
Theorem evict_tv_le_of_z_bounds n kept x L U :
  z_evicted n kept x <= U -> 0 < L -> L <= z_kept n kept x ->
  tv n (softmax n x) (softmax_kept n kept x) <= U / (L + U).
Proof.
  intros HU HL HK. rewrite evict_tv_eq_mass by lra.
  apply evict_tv_le_of_bounds; [apply z_evicted_nonneg|exact HU|exact HL|exact HK].
Qed.

(** The same bound stated directly on the eviction error. *)
Lemma evict_tv_le_of_bounds_tv n kept x L U :
  z_evicted n kept x <= U -> 0 < L -> L <= z_kept n kept x ->
  tv n (softmax n x) (softmax_kept n kept x) <= U / (L + U).
Proof.
  intros HU HL HK. rewrite evict_tv_eq_mass by lra.
  apply evict_tv_le_of_bounds; [apply z_evicted_nonneg|assumption..].
Qed.

(** ** T7c *)

(** A group centre and per-band radii bound the logit of every key in the group, for
    every query, so evicted tokens need not be kept to bound their logits. *)
Theorem logit_le_group_bound D NB band s q k mu R :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  0 <= s ->
  (forall b, (b < NB)%nat -> band_norm D band (fun i => k i - mu i) b <= R b) ->
  s * inner D q k <= s * inner D q mu + s * sum NB (fun b => band_norm D band q b * R b).
Proof.
  intros Hband Hs HR.
  assert (Hsplit : s * inner D q k = s * inner D q mu + s * inner D q (fun i => k i - mu i)).
  { unfold inner. rewrite <- Rmult_plus_distr_l, <- sum_add. f_equal.
    apply sum_ext. intros. ring. }
  rewrite Hsplit. apply Rplus_le_compat_l.
  eapply Rle_trans; [apply Rle_abs|].
  apply abs_logit_error_le_of_witness; assumption.
Qed.

(** Group witnesses give an upper bound on the evicted mass [Z_E] that needs only one
    centre, one count and one radius per band for each group. *)
Theorem z_evicted_le_group_witness n kept x D NB band G group s q
    (k mu R : nat -> nat -> R) :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  0 <= s ->
  (forall j, (j < n)%nat -> kept j = false -> (group j < G)%nat) ->
  (forall j, (j < n)%nat -> kept j = false -> forall b, (b < NB)%nat ->
     band_norm D band (fun i => k j i - mu (group j) i) b <= R (group j) b) ->
  (forall j, (j < n)%nat -> x j = s * inner D q (k j)) ->
  z_evicted n kept x
  <= sum G (fun g => INR (group_count n kept group g)
                     * exp (s * inner D q (mu g)
                            + s * sum NB (fun b => band_norm D band q b * R g b))).
Proof.
  intros Hband Hs HG HR Hx.
  set (B g := s * inner D q (mu g) + s * sum NB (fun b => band_norm D band q b * R g b)).
  apply Rle_trans with (sum n (fun j => if kept j then 0 else exp (B (group j)))).
  - apply sum_le. intros j Hj. destruct (kept j) eqn:Hk; [lra|].
    assert (Hle : x j <= B (group j)).
    { rewrite Hx by exact Hj. unfold B.
      apply logit_le_group_bound; [exact Hband|exact Hs|]. apply HR; assumption. }
    destruct Hle as [Hlt|Heq]; [left; apply exp_increasing; exact Hlt|rewrite Heq; lra].
  - rewrite (sum_eq_sum_bands n G group).
    + right. apply sum_ext. intros g _. rewrite INR_group_count, <- sum_scal_r.
      apply sum_ext. intros j _.
      destruct (Nat.eqb_spec (group j) g) as [E|E]; [rewrite E|];
        destruct (kept j); unfold B; ring.
    + intros j Hj. destruct (kept j) eqn:Hk; [right; reflexivity|].
      left. apply HG; assumption.
Qed.

(** ** T7d *)

(** Total variation obeys the triangle inequality, so the eviction error and the
    quantization error of the kept tokens add up to a bound on the served distribution. *)
Theorem tv_triangle n p q r : tv n p r <= tv n p q + tv n q r.
Proof.
  unfold tv. rewrite <- Rmult_plus_distr_l, <- sum_add.
  apply Rmult_le_compat_l; [lra|]. apply sum_le. intros j _.
  replace (p j - r j) with ((p j - q j) + (q j - r j)) by ring.
  apply Rabs_triang.
Qed.

(** * The eviction glue on a quantized cache (issue 9, item 3)

    The cache serves stored keys [kt j] (quantized); the exact keys are [k j], with a band
    witness [||(k j - kt j)_b|| <= rho j b] (T4c). Exact logits [x j = s <q, k j>], served
    logits [xt j = s <q, kt j>]. The group radii and the kept mass are measured on the stored
    keys (fast.core.evict: build_group_witness with rho, log_z_kept_lower with c); the
    certificate is about the exact distribution [softmax x] against the served kept one
    [softmax_kept xt]. *)

Lemma band_norm_ext D band x y b :
  (forall i, (i < D)%nat -> x i = y i) -> band_norm D band x b = band_norm D band y b.
Proof.
  intros H. unfold band_norm. f_equal. apply sum_ext. intros i Hi. rewrite H by exact Hi. reflexivity.
Qed.

(** The band norm is a seminorm: it obeys the triangle inequality. *)
Lemma band_norm_add_le D band a c b :
  band_norm D band (fun i => a i + c i) b <= band_norm D band a b + band_norm D band c b.
Proof.
  set (ra := fun i => if Nat.eqb (band i) b then a i else 0).
  set (rc := fun i => if Nat.eqb (band i) b then c i else 0).
  assert (Ha : band_norm D band a b = norm D ra)
    by (unfold band_norm, norm, ra; rewrite restrict_sq; reflexivity).
  assert (Hc : band_norm D band c b = norm D rc)
    by (unfold band_norm, norm, rc; rewrite restrict_sq; reflexivity).
  assert (Hac : band_norm D band (fun i => a i + c i) b = norm D (fun i => ra i + rc i)).
  { unfold band_norm, norm. f_equal. apply sum_ext. intros i _. unfold ra, rc.
    destruct (Nat.eqb (band i) b); ring. }
  rewrite Ha, Hc, Hac.
  assert (Hcs := cauchy_schwarz D ra rc).
  unfold norm in *.
  assert (Hsq : sum D (fun i => (ra i + rc i) ^ 2)
                = sum D (fun i => ra i ^ 2) + 2 * sum D (fun i => ra i * rc i)
                  + sum D (fun i => rc i ^ 2)).
  { rewrite <- sum_scal_l, <- !sum_add. apply sum_ext. intros. ring. }
  assert (HA := sum_sq_nonneg D ra). assert (HC := sum_sq_nonneg D rc).
  set (A := sum D (fun i => ra i ^ 2)) in *. set (C := sum D (fun i => rc i ^ 2)) in *.
  set (IN := sum D (fun i => ra i * rc i)) in *.
  assert (sA := sqrt_pos A). assert (sC := sqrt_pos C).
  rewrite <- (sqrt_pow2 (sqrt A + sqrt C)) by lra.
  apply sqrt_le_1_alt. rewrite Hsq.
  replace ((sqrt A + sqrt C) ^ 2) with (sqrt A ^ 2 + 2 * (sqrt A * sqrt C) + sqrt C ^ 2) by ring.
  rewrite !pow2_sqrt by assumption. lra.
Qed.

(** ** T7e *)

(** A radius measured on the stored key, enlarged by the stored key's witness, bounds the
    exact key: ||(k - mu)_b|| <= ||(k~ - mu)_b|| + rho_b whenever ||(k - k~)_b|| <= rho_b. *)
Theorem band_norm_sub_le_of_stored D band k kt mu rho b :
  band_norm D band (fun i => k i - kt i) b <= rho ->
  band_norm D band (fun i => k i - mu i) b <= band_norm D band (fun i => kt i - mu i) b + rho.
Proof.
  intros H.
  rewrite (band_norm_ext D band _ (fun i => (kt i - mu i) + (k i - kt i))) by (intros; ring).
  eapply Rle_trans; [apply band_norm_add_le|]. lra.
Qed.

(** Group witnesses built from the STORED evicted keys, with radii enlarged by their band
    witness, bound the evicted mass of the EXACT keys: the quantized cache needs no exact copy
    of what it evicts. *)
Theorem z_evicted_le_group_witness_of_stored n kept x D NB band G group s q
    (k kt mu R rho : nat -> nat -> R) :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  0 <= s ->
  (forall j, (j < n)%nat -> kept j = false -> (group j < G)%nat) ->
  (forall j, (j < n)%nat -> kept j = false -> forall b, (b < NB)%nat ->
     band_norm D band (fun i => k j i - kt j i) b <= rho j b) ->
  (forall j, (j < n)%nat -> kept j = false -> forall b, (b < NB)%nat ->
     band_norm D band (fun i => kt j i - mu (group j) i) b + rho j b <= R (group j) b) ->
  (forall j, (j < n)%nat -> x j = s * inner D q (k j)) ->
  z_evicted n kept x
  <= sum G (fun g => INR (group_count n kept group g)
                     * exp (s * inner D q (mu g)
                            + s * sum NB (fun b => band_norm D band q b * R g b))).
Proof.
  intros Hband Hs HG Hrho HR Hx.
  apply (z_evicted_le_group_witness n kept x D NB band G group s q k mu R); try assumption.
  intros j Hj Hk b Hb.
  eapply Rle_trans; [apply band_norm_sub_le_of_stored; apply Hrho; assumption|].
  apply HR; assumption.
Qed.

(** ** T7f *)

(** The kept mass of the exact logits is at least the served kept logits lowered by their
    error bounds: Z_K >= sum_{j in K} e^{x~_j - c_j} whenever |x_j - x~_j| <= c_j on K. *)
Theorem sum_exp_sub_le_z_kept_of_abs_shift_le n kept x xt c :
  (forall j, (j < n)%nat -> kept j = true -> Rabs (x j - xt j) <= c j) ->
  sum n (fun j => if kept j then exp (xt j - c j) else 0) <= z_kept n kept x.
Proof.
  intros Hc. unfold z_kept. apply sum_le. intros j Hj. destruct (kept j) eqn:Hk; [|lra].
  destruct (abs_le_between _ _ (Hc j Hj Hk)). apply exp_mono. lra.
Qed.

(** * The kept tokens as a softmax of their own: [kept_at i], i < n_kept, lists K in order *)

Fixpoint kept_list (n : nat) (kept : nat -> bool) : list nat :=
  match n with
  | O => nil
  | S m => kept_list m kept ++ (if kept m then m :: nil else nil)
  end.

Definition n_kept (n : nat) (kept : nat -> bool) : nat := length (kept_list n kept).

Definition kept_at (n : nat) (kept : nat -> bool) (i : nat) : nat := nth i (kept_list n kept) O.

Lemma sum_kept_eq n (kept : nat -> bool) (f : nat -> R) :
  sum n (fun j => if kept j then f j else 0)
  = sum (n_kept n kept) (fun i => f (kept_at n kept i)).
Proof.
  unfold n_kept, kept_at. induction n as [|n IH]; [reflexivity|].
  rewrite sum_succ, IH. cbn [kept_list].
  destruct (kept n).
  - rewrite app_length. simpl length. rewrite Nat.add_1_r, sum_succ. f_equal.
    + apply sum_ext. intros i Hi. rewrite app_nth1 by exact Hi. reflexivity.
    + rewrite app_nth2 by lia. rewrite Nat.sub_diag. reflexivity.
  - rewrite app_nil_r. ring.
Qed.

Lemma In_kept_list n (kept : nat -> bool) j : In j (kept_list n kept) -> (j < n)%nat /\ kept j = true.
Proof.
  induction n as [|n IH]; simpl; [tauto|]. intros H. apply in_app_or in H.
  destruct H as [H|H].
  - destruct (IH H). split; [lia|assumption].
  - destruct (kept n) eqn:Hk; simpl in H; [|contradiction].
    destruct H as [H|[]]. subst. split; [lia|exact Hk].
Qed.

Lemma kept_at_spec n (kept : nat -> bool) i :
  (i < n_kept n kept)%nat -> (kept_at n kept i < n)%nat /\ kept (kept_at n kept i) = true.
Proof. intros Hi. apply In_kept_list. apply nth_In. exact Hi. Qed.

Lemma n_kept_pos n (kept : nat -> bool) : (exists j, (j < n)%nat /\ kept j = true) -> (0 < n_kept n kept)%nat.
Proof.
  intros [j [Hj Hk]].
  assert (HIn : In j (kept_list n kept)).
  { clear -Hj Hk. induction n as [|n IH]; [lia|]. simpl. apply in_or_app.
    destruct (Nat.eq_dec j n) as [->|Hne].
    - right. rewrite Hk. left. reflexivity.
    - left. apply IH. lia. }
  unfold n_kept. destruct (kept_list n kept); [contradiction|simpl; lia].
Qed.

Lemma kept_exists_of_z_kept_pos n kept x :
  0 < z_kept n kept x -> exists j, (j < n)%nat /\ kept j = true.
Proof.
  unfold z_kept. rewrite (sum_kept_eq n kept (fun j => exp (x j))). intros H.
  destruct (n_kept n kept) eqn:E; [simpl in H; lra|].
  exists (kept_at n kept 0). apply kept_at_spec. lia.
Qed.

Lemma softmax_kept_at n kept x i :
  (i < n_kept n kept)%nat ->
  softmax_kept n kept x (kept_at n kept i)
  = softmax (n_kept n kept) (fun i => x (kept_at n kept i)) i.
Proof.
  intros Hi. destruct (kept_at_spec n kept i Hi) as [_ Hk].
  unfold softmax_kept, softmax. rewrite Hk. unfold z_kept.
  rewrite (sum_kept_eq n kept (fun j => exp (x j))). reflexivity.
Qed.

Lemma sum_softmax_kept_eq n kept x f :
  sum n (fun j => softmax_kept n kept x j * f j)
  = sum (n_kept n kept) (fun i => softmax (n_kept n kept) (fun i => x (kept_at n kept i)) i
                                  * f (kept_at n kept i)).
Proof.
  rewrite (sum_ext n _ (fun j => if kept j then softmax_kept n kept x j * f j else 0)).
  - rewrite (sum_kept_eq n kept (fun j => softmax_kept n kept x j * f j)).
    apply sum_ext. intros i Hi. rewrite softmax_kept_at by exact Hi. reflexivity.
  - intros j _. unfold softmax_kept. destruct (kept j); ring.
Qed.

Lemma tv_kept_eq n kept x xt :
  tv n (softmax_kept n kept x) (softmax_kept n kept xt)
  = tv (n_kept n kept) (softmax (n_kept n kept) (fun i => x (kept_at n kept i)))
                       (softmax (n_kept n kept) (fun i => xt (kept_at n kept i))).
Proof.
  unfold tv. f_equal.
  rewrite (sum_ext n _ (fun j => if kept j
                                 then Rabs (softmax_kept n kept x j - softmax_kept n kept xt j)
                                 else 0)).
  - rewrite (sum_kept_eq n kept (fun j => Rabs (softmax_kept n kept x j - softmax_kept n kept xt j))).
    apply sum_ext. intros i Hi. rewrite !softmax_kept_at by exact Hi. reflexivity.
  - intros j _. unfold softmax_kept. destruct (kept j); [reflexivity|].
    rewrite Rminus_0_r, Rabs_R0. reflexivity.
Qed.

(** ** T7g: T1c, T2c, T2d on the kept subset *)

(** The served kept distribution is within tanh(c/2) of the exact kept one when every kept
    logit moves by at most c (T1c on K). *)
Theorem tv_kept_le_tanh_of_abs_shift_le n kept x xt c :
  (exists j, (j < n)%nat /\ kept j = true) ->
  (forall j, (j < n)%nat -> kept j = true -> Rabs (x j - xt j) <= c) ->
  tv n (softmax_kept n kept x) (softmax_kept n kept xt) <= tanh (c / 2).
Proof.
  intros HK Hc. rewrite tv_kept_eq.
  apply tv_le_tanh_of_abs_shift_le; [apply n_kept_pos; exact HK|].
  intros i Hi. destruct (kept_at_spec n kept i Hi). apply Hc; assumption.
Qed.

(** T2c on K: the observable form 1 - B/A, with A and B summed over the served kept weights. *)
Theorem tv_kept_le_one_sub_b_div_a_of_abs_shift_le n kept x xt c :
  (exists j, (j < n)%nat /\ kept j = true) ->
  (forall j, (j < n)%nat -> kept j = true -> Rabs (x j - xt j) <= c j) ->
  tv n (softmax_kept n kept x) (softmax_kept n kept xt)
  <= 1 - sum n (fun j => softmax_kept n kept xt j * exp (- c j))
         / sum n (fun j => softmax_kept n kept xt j * exp (c j)).
Proof.
  intros HK Hc. rewrite tv_kept_eq.
  rewrite (sum_softmax_kept_eq n kept xt (fun j => exp (- c j))).
  rewrite (sum_softmax_kept_eq n kept xt (fun j => exp (c j))).
  apply (tv_le_one_sub_b_div_a_of_abs_shift_le _ _ _ (fun i => c (kept_at n kept i))).
  - apply n_kept_pos. exact HK.
  - intros i Hi. destruct (kept_at_spec n kept i Hi). apply Hc; assumption.
Qed.

(** T2d on K: the observable form (A^2 - 1)/2. *)
Theorem tv_kept_le_a_sq_form_of_abs_shift_le n kept x xt c :
  (exists j, (j < n)%nat /\ kept j = true) ->
  (forall j, (j < n)%nat -> kept j = true -> Rabs (x j - xt j) <= c j) ->
  tv n (softmax_kept n kept x) (softmax_kept n kept xt)
  <= (sum n (fun j => softmax_kept n kept xt j * exp (c j)) ^ 2 - 1) / 2.
Proof.
  intros HK Hc. rewrite tv_kept_eq.
  rewrite (sum_softmax_kept_eq n kept xt (fun j => exp (c j))).
  apply (tv_le_a_sq_form_of_abs_shift_le _ _ _ (fun i => c (kept_at n kept i))).
  - apply n_kept_pos. exact HK.
  - intros i Hi. destruct (kept_at_spec n kept i Hi). apply Hc; assumption.
Qed.

(** ** T7h: the composed certificate *)

(** Eviction and quantization of the kept keys add up (T7d with T7b): any bound T on the
    kept part gives TV(p, p~^K) <= U/(L+U) + T. *)
Theorem tv_evict_quant_le_of_kept_tv n kept x xt L U T :
  z_evicted n kept x <= U -> 0 < L -> L <= z_kept n kept x ->
  tv n (softmax_kept n kept x) (softmax_kept n kept xt) <= T ->
  tv n (softmax n x) (softmax_kept n kept xt) <= U / (L + U) + T.
Proof.
  intros HU HL HK HT.
  eapply Rle_trans; [apply (tv_triangle n _ (softmax_kept n kept x))|].
  apply Rplus_le_compat; [apply evict_tv_le_of_z_bounds; assumption|exact HT].
Qed.

(** End to end on a quantized cache with eviction: from the stored keys, their band witness
    rho, the group witness of the evicted stored keys (radii enlarged by rho), the kept-mass
    lower bound L of T7f and the kept part's forms, the exact attention distribution over ALL
    tokens is within U/(L+U) + min(tanh(cmax/2), 1 - B/A, (A^2-1)/2) of the served kept one. *)
Theorem tv_served_le_of_witnesses n kept D NB band G group s q
    (k kt mu R rho : nat -> nat -> R) cmax :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  0 <= s ->
  (exists j, (j < n)%nat /\ kept j = true) ->
  (forall j, (j < n)%nat -> kept j = false -> (group j < G)%nat) ->
  (forall j, (j < n)%nat -> forall b, (b < NB)%nat ->
     band_norm D band (fun i => k j i - kt j i) b <= rho j b) ->
  (forall j, (j < n)%nat -> kept j = false -> forall b, (b < NB)%nat ->
     band_norm D band (fun i => kt j i - mu (group j) i) b + rho j b <= R (group j) b) ->
  (forall j, (j < n)%nat -> kept j = true ->
     s * sum NB (fun b => band_norm D band q b * rho j b) <= cmax) ->
  let x := fun j => s * inner D q (k j) in
  let xt := fun j => s * inner D q (kt j) in
  let c := fun j => s * sum NB (fun b => band_norm D band q b * rho j b) in
  let U := sum G (fun g => INR (group_count n kept group g)
                           * exp (s * inner D q (mu g)
                                  + s * sum NB (fun b => band_norm D band q b * R g b))) in
  let L := sum n (fun j => if kept j then exp (xt j - c j) else 0) in
  let A := sum n (fun j => softmax_kept n kept xt j * exp (c j)) in
  let B := sum n (fun j => softmax_kept n kept xt j * exp (- c j)) in
  tv n (softmax n x) (softmax_kept n kept xt)
  <= U / (L + U) + Rmin (tanh (cmax / 2)) (Rmin (1 - B / A) ((A ^ 2 - 1) / 2)).
Proof.
  intros Hband Hs HK HG Hrho HR Hcmax x xt c U L A B.
  assert (Hc : forall j, (j < n)%nat -> kept j = true -> Rabs (x j - xt j) <= c j).
  { intros j Hj _. unfold x, xt, c.
    apply abs_logit_sub_le_of_witness; [exact Hband|exact Hs|]. apply Hrho. exact Hj. }
  assert (HL : 0 < L).
  { unfold L. rewrite (sum_kept_eq n kept (fun j => exp (xt j - c j))).
    apply sum_pos; [apply n_kept_pos; exact HK|]. intros. apply exp_pos. }
  apply tv_evict_quant_le_of_kept_tv.
  - apply (z_evicted_le_group_witness_of_stored n kept x D NB band G group s q k kt mu R rho);
      try assumption.
    + intros j Hj _. apply Hrho. exact Hj.
    + intros j Hj. reflexivity.
  - exact HL.
  - apply sum_exp_sub_le_z_kept_of_abs_shift_le. exact Hc.
  - unfold Rmin. destruct (Rle_dec (1 - B / A) ((A ^ 2 - 1) / 2));
      destruct Rle_dec.
    + apply tv_kept_le_tanh_of_abs_shift_le; [exact HK|].
      intros j Hj Hk. eapply Rle_trans; [apply Hc; assumption|apply Hcmax; assumption].
    + apply tv_kept_le_one_sub_b_div_a_of_abs_shift_le; assumption.
    + apply tv_kept_le_tanh_of_abs_shift_le; [exact HK|].
      intros j Hj Hk. eapply Rle_trans; [apply Hc; assumption|apply Hcmax; assumption].
    + apply tv_kept_le_a_sq_form_of_abs_shift_le; assumption.
Qed.
