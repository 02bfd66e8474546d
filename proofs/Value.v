(** T5: value error. The attention output moves by at most TV(p, p~) times the
    diameter of the values plus the served-weighted value errors, and the diameter
    of the exact values can be bounded at run time from the served values.
    Vectors are [nat -> R] read on 0..d-1; a family of token vectors is
    [nat -> nat -> R], token j, coordinate i. *)
From KVCert Require Import Prelim.
From Coq Require Import Reals Lra Lia.
Open Scope R_scope.

(** * Euclidean norm: Minkowski and scaling *)

Lemma norm_ext d u v : (forall i, (i < d)%nat -> u i = v i) -> norm d u = norm d v.
Proof.
  intros H. unfold norm. f_equal. apply sum_ext. intros i Hi. rewrite H by exact Hi.
  reflexivity.
Qed.

Lemma norm_zero d : norm d (fun _ => 0) = 0.
Proof.
  unfold norm. replace (sum d (fun _ => 0 ^ 2)) with 0; [apply sqrt_0|].
  rewrite sum_const. ring.
Qed.

Lemma norm_add_le d u v :
  norm d (fun i => u i + v i) <= norm d u + norm d v.
Proof.
  pose proof (cauchy_schwarz d u v) as Hcs.
  pose proof (norm_nonneg d u). pose proof (norm_nonneg d v).
  rewrite <- (sqrt_pow2 (norm d u + norm d v)) by lra.
  unfold norm at 1. apply sqrt_le_1_alt.
  replace (sum d (fun i => (u i + v i) ^ 2))
    with (sum d (fun i => u i ^ 2) + 2 * sum d (fun i => u i * v i) + sum d (fun i => v i ^ 2)).
  - replace ((norm d u + norm d v) ^ 2)
      with (norm d u ^ 2 + 2 * (norm d u * norm d v) + norm d v ^ 2) by ring.
    assert (Eu : norm d u ^ 2 = sum d (fun i => u i ^ 2)) by (apply pow2_sqrt, sum_sq_nonneg).
    assert (Ev : norm d v ^ 2 = sum d (fun i => v i ^ 2)) by (apply pow2_sqrt, sum_sq_nonneg).
    rewrite Eu, Ev. lra.
  - rewrite <- sum_scal_l, <- !sum_add. apply sum_ext. intros. ring.
Qed.

Lemma norm_scal d c v : norm d (fun i => c * v i) = Rabs c * norm d v.
Proof.
  unfold norm.
  replace (sum d (fun i => (c * v i) ^ 2)) with (c ^ 2 * sum d (fun i => v i ^ 2)).
  - rewrite sqrt_mult_alt by apply pow2_ge_0.
    rewrite <- pow2_abs, sqrt_pow2 by apply Rabs_pos. reflexivity.
  - rewrite <- sum_scal_l. apply sum_ext. intros. ring.
Qed.

Lemma norm_opp d v : norm d (fun i => - v i) = norm d v.
Proof.
  rewrite <- (Rmult_1_l (norm d v)), <- Rabs_R1, <- Rabs_Ropp, <- norm_scal.
  apply norm_ext. intros. ring.
Qed.

Lemma norm_sub_le d u v :
  norm d (fun i => u i - v i) <= norm d u + norm d v.
Proof.
  rewrite <- (norm_opp d v). unfold Rminus. apply norm_add_le.
Qed.

(** Triangle inequality over a finite sum of vectors. *)
Lemma norm_sum_le d n (w : nat -> nat -> R) :
  norm d (fun i => sum n (fun j => w j i)) <= sum n (fun j => norm d (w j)).
Proof.
  induction n as [|n IH]; simpl.
  - rewrite norm_zero. lra.
  - eapply Rle_trans; [apply norm_add_le|]. lra.
Qed.

Lemma norm_wsum_le d n (a : nat -> R) (w : nat -> nat -> R) :
  norm d (fun i => sum n (fun j => a j * w j i))
  <= sum n (fun j => Rabs (a j) * norm d (w j)).
Proof.
  eapply Rle_trans; [apply (norm_sum_le d n (fun j i => a j * w j i))|].
  apply sum_le. intros. rewrite norm_scal. lra.
Qed.

(** * Signed weights summing to zero *)

(** Double sum of pairwise differences weighted by positive and negative parts. *)
Lemma double_sum_diff n (a b : nat -> R) (v : nat -> nat -> R) i :
  sum n (fun j => sum n (fun k => a j * b k * (v j i - v k i)))
  = sum n b * sum n (fun j => a j * v j i) - sum n a * sum n (fun k => b k * v k i).
Proof.
  rewrite (sum_ext n _ (fun j => sum n b * (a j * v j i) - a j * sum n (fun k => b k * v k i))).
  - rewrite sum_sub, sum_scal_l, sum_scal_r. ring.
  - intros j _. rewrite <- sum_scal_r, <- sum_scal_l, <- sum_sub.
    apply sum_ext. intros. ring.
Qed.

(** A zero-sum combination of vectors of diameter at most diam has norm at most
    half its l1 mass times diam. *)
Lemma norm_zero_sum_comb_le n d (delta : nat -> R) (v : nat -> nat -> R) diam :
  sum n delta = 0 ->
  (forall j k, (j < n)%nat -> (k < n)%nat -> norm d (fun i => v j i - v k i) <= diam) ->
  norm d (fun i => sum n (fun j => delta j * v j i))
  <= / 2 * sum n (fun j => Rabs (delta j)) * diam.
Proof.
  intros Hs Hdiam.
  set (pos := fun j => Rmax (delta j) 0).
  set (neg := fun j => Rmax (- delta j) 0).
  assert (Hpos : forall j, 0 <= pos j) by (intros; apply Rmax_r).
  assert (Hneg : forall j, 0 <= neg j) by (intros; apply Rmax_r).
  assert (Hsplit : forall j, delta j = pos j - neg j).
  { intros j. unfold pos, neg, Rmax.
    destruct (Rle_dec (delta j) 0), (Rle_dec (- delta j) 0); lra. }
  assert (Habs : forall j, Rabs (delta j) = pos j + neg j).
  { intros j. unfold pos, neg, Rmax.
    destruct (Rle_dec (delta j) 0), (Rle_dec (- delta j) 0);
      unfold Rabs; destruct (Rcase_abs (delta j)); lra. }
  set (T := sum n neg).
  assert (HposT : sum n pos = T).
  { rewrite (sum_ext n delta (fun j => pos j - neg j)) in Hs by (intros; apply Hsplit).
    rewrite sum_sub in Hs. unfold T. lra. }
  assert (Hmass : / 2 * sum n (fun j => Rabs (delta j)) = T).
  { rewrite (sum_ext n _ (fun j => pos j + neg j)) by (intros; apply Habs).
    rewrite sum_add, HposT. unfold T. lra. }
  rewrite Hmass.
  assert (HT : 0 <= T) by (apply sum_nonneg; intros; apply Hneg).
  destruct (Req_dec T 0) as [HT0|HT0].
  - (* no mass: every weight is zero *)
    assert (Hz : forall j, (j < n)%nat -> delta j = 0).
    { intros j Hj. rewrite Hsplit.
      rewrite (sum_nonneg_eq_0 n pos (fun j _ => Hpos j) (eq_trans HposT HT0) j Hj).
      rewrite (sum_nonneg_eq_0 n neg (fun j _ => Hneg j) HT0 j Hj). ring. }
    rewrite (norm_ext d _ (fun _ => 0)).
    + rewrite norm_zero, HT0. lra.
    + intros i _. rewrite (sum_ext n _ (fun _ => 0)) by (intros j Hj; rewrite Hz by exact Hj; ring).
      rewrite sum_const. ring.
  - (* T * (sum delta v) is the double sum of pos_j neg_k (v_j - v_k) *)
    assert (HTp : 0 < T) by lra.
    assert (Hid : forall i, T * sum n (fun j => delta j * v j i)
      = sum n (fun j => sum n (fun k => pos j * neg k * (v j i - v k i)))).
    { intros i. rewrite double_sum_diff, HposT. fold T.
      rewrite (sum_ext n _ (fun j => pos j * v j i - neg j * v j i))
        by (intros; rewrite Hsplit; ring).
      rewrite sum_sub. ring. }
    assert (Hbound : T * norm d (fun i => sum n (fun j => delta j * v j i)) <= T * (T * diam)).
    { rewrite <- (Rabs_pos_eq T) at 1 by exact HT. rewrite <- norm_scal.
      rewrite (norm_ext d _ _ (fun i _ => Hid i)).
      eapply Rle_trans;
        [apply (norm_sum_le d n (fun j i => sum n (fun k => pos j * neg k * (v j i - v k i))))|].
      apply (Rle_trans _ (sum n (fun j => sum n (fun k => pos j * neg k * diam)))).
      - apply sum_le. intros j Hj.
        eapply Rle_trans;
          [apply (norm_wsum_le d n (fun k => pos j * neg k) (fun k i => v j i - v k i))|].
        apply sum_le. intros k Hk.
        rewrite Rabs_pos_eq by (apply Rmult_le_pos; auto).
        apply Rmult_le_compat_l; [apply Rmult_le_pos; auto|]. apply Hdiam; assumption.
      - rewrite (sum_ext n _ (fun j => pos j * (T * diam))).
        + rewrite sum_scal_r, HposT. lra.
        + intros j _. unfold T. rewrite <- sum_scal_r, <- sum_scal_l.
          apply sum_ext. intros. ring. }
    apply Rmult_le_reg_l with T; assumption.
Qed.

(** * T5 *)

(** The exact attention output [o i = sum_j p_j v_j i]. *)
Definition attn_out (n : nat) (p : nat -> R) (v : nat -> nat -> R) (i : nat) : R :=
  sum n (fun j => p j * v j i).

(** The served output is within TV(p, p~) * diam{v} + sum_j p~_j ||e_j|| of the exact
    one, so attention and value errors combine into one sound output bound. *)
Theorem output_error_le_of_tv n d (p pt : nat -> R) (v vt : nat -> nat -> R) diam :
  sum n p = 1 ->
  (forall j, (j < n)%nat -> 0 <= pt j) -> sum n pt = 1 ->
  (forall j k, (j < n)%nat -> (k < n)%nat -> norm d (fun i => v j i - v k i) <= diam) ->
  norm d (fun i => attn_out n p v i - attn_out n pt vt i)
  <= tv n p pt * diam + sum n (fun j => pt j * norm d (fun i => v j i - vt j i)).
Proof.
  intros Hp Hpt0 Hpt Hdiam. unfold attn_out.
  rewrite (norm_ext d _ (fun i => sum n (fun j => (p j - pt j) * v j i)
                                  + sum n (fun j => pt j * (v j i - vt j i)))).
  2: { intros i _. rewrite <- sum_sub, <- sum_add. apply sum_ext. intros. ring. }
  eapply Rle_trans; [apply norm_add_le|]. apply Rplus_le_compat.
  - unfold tv. apply norm_zero_sum_comb_le; [|exact Hdiam].
    rewrite sum_sub, Hp, Hpt. ring.
  - eapply Rle_trans; [apply (norm_wsum_le d n pt (fun j i => v j i - vt j i))|].
    apply sum_le. intros j Hj. rewrite Rabs_pos_eq by (apply Hpt0; exact Hj). lra.
Qed.

(** The diameter of the exact values, which the serving side cannot see, is at most
    the diameter of the served values plus twice the largest value error. *)
Theorem diam_le_of_value_errors n d (v vt : nat -> nat -> R) diamt emax :
  (forall j k, (j < n)%nat -> (k < n)%nat -> norm d (fun i => vt j i - vt k i) <= diamt) ->
  (forall j, (j < n)%nat -> norm d (fun i => v j i - vt j i) <= emax) ->
  forall j k, (j < n)%nat -> (k < n)%nat ->
  norm d (fun i => v j i - v k i) <= diamt + 2 * emax.
Proof.
  intros Hdt He j k Hj Hk.
  rewrite (norm_ext d _ (fun i => (v j i - vt j i) + ((vt j i - vt k i) - (v k i - vt k i))))
    by (intros; ring).
  eapply Rle_trans; [apply norm_add_le|].
  pose proof (norm_sub_le d (fun i => vt j i - vt k i) (fun i => v k i - vt k i)).
  pose proof (Hdt j k Hj Hk). pose proof (He j Hj). pose proof (He k Hk). lra.
Qed.
