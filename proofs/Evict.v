(** T7: eviction. Tokens 0..n-1 with logits [x]; [kept j = true] marks the kept set K,
    the others form the evicted set E. [p^K] is the softmax over K only. *)
From KVCert Require Import Prelim Band.
From Coq Require Import Reals Lra Lia.
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
