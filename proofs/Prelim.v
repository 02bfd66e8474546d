(** Shared vocabulary of the kvcert development: finite sums over indices 0..n-1,
    total variation, softmax, the Euclidean norm and Cauchy-Schwarz. Vectors and
    distributions are functions [nat -> R] read on their first n indices. *)
From Coq Require Import Reals Lra Lia.
Open Scope R_scope.

Fixpoint sum (n : nat) (f : nat -> R) : R :=
  match n with
  | O => 0
  | S m => sum m f + f m
  end.

(** Total variation distance between two vectors on indices 0..n-1. *)
Definition tv (n : nat) (p q : nat -> R) : R := / 2 * sum n (fun j => Rabs (p j - q j)).

(** Softmax of logits x on indices 0..n-1. *)
Definition softmax (n : nat) (x : nat -> R) (j : nat) : R :=
  exp (x j) / sum n (fun i => exp (x i)).

(** Euclidean norm of a vector on indices 0..d-1. *)
Definition norm (d : nat) (v : nat -> R) : R := sqrt (sum d (fun i => v i ^ 2)).

(** * Finite sums *)

Lemma sum_succ n f : sum (S n) f = sum n f + f n.
Proof. reflexivity. Qed.

Lemma sum_ext n f g : (forall j, (j < n)%nat -> f j = g j) -> sum n f = sum n g.
Proof.
  induction n as [|n IH]; intros H; simpl; [reflexivity|].
  rewrite IH by (intros; apply H; lia). rewrite H by lia. reflexivity.
Qed.

Lemma sum_add n f g : sum n (fun j => f j + g j) = sum n f + sum n g.
Proof. induction n as [|n IH]; simpl; [lra|]. rewrite IH. lra. Qed.

Lemma sum_sub n f g : sum n (fun j => f j - g j) = sum n f - sum n g.
Proof. induction n as [|n IH]; simpl; [lra|]. rewrite IH. lra. Qed.

Lemma sum_scal_l n c f : sum n (fun j => c * f j) = c * sum n f.
Proof. induction n as [|n IH]; simpl; [lra|]. rewrite IH. lra. Qed.

Lemma sum_scal_r n c f : sum n (fun j => f j * c) = sum n f * c.
Proof. induction n as [|n IH]; simpl; [lra|]. rewrite IH. lra. Qed.

Lemma sum_const n c : sum n (fun _ => c) = INR n * c.
Proof.
  induction n as [|n IH]; simpl sum; [simpl; lra|]. rewrite IH, S_INR. lra.
Qed.

Lemma sum_le n f g : (forall j, (j < n)%nat -> f j <= g j) -> sum n f <= sum n g.
Proof.
  induction n as [|n IH]; intros H; simpl; [lra|].
  assert (sum n f <= sum n g) by (apply IH; intros; apply H; lia).
  assert (f n <= g n) by (apply H; lia). lra.
Qed.

Lemma sum_nonneg n f : (forall j, (j < n)%nat -> 0 <= f j) -> 0 <= sum n f.
Proof.
  intros H. replace 0 with (sum n (fun _ => 0)).
  - apply sum_le. exact H.
  - rewrite sum_const. lra.
Qed.

Lemma sum_pos n f : (0 < n)%nat -> (forall j, (j < n)%nat -> 0 < f j) -> 0 < sum n f.
Proof.
  destruct n as [|n]; intros Hn H; [lia|]. simpl.
  assert (0 <= sum n f) by (apply sum_nonneg; intros; left; apply H; lia).
  assert (0 < f n) by (apply H; lia). lra.
Qed.

Lemma sum_abs_le n f : Rabs (sum n f) <= sum n (fun j => Rabs (f j)).
Proof.
  induction n as [|n IH]; simpl; [rewrite Rabs_R0; lra|].
  eapply Rle_trans; [apply Rabs_triang|]. lra.
Qed.

Lemma sum_nonneg_eq_0 n f :
  (forall j, (j < n)%nat -> 0 <= f j) -> sum n f = 0 ->
  forall j, (j < n)%nat -> f j = 0.
Proof.
  induction n as [|n IH]; intros Hf Hs j Hj; [lia|]. simpl in Hs.
  assert (0 <= sum n f) by (apply sum_nonneg; intros; apply Hf; lia).
  assert (0 <= f n) by (apply Hf; lia).
  destruct (Nat.eq_dec j n) as [->|Hjn]; [lra|].
  apply IH; [intros; apply Hf; lia|lra|lia].
Qed.

Lemma sum_split a b f :
  sum (a + b) f = sum a f + sum b (fun i => f (a + i)%nat).
Proof.
  induction b as [|b IH]; simpl.
  - rewrite Nat.add_0_r. lra.
  - rewrite Nat.add_succ_r. simpl. rewrite IH. lra.
Qed.

Lemma sum_swap m n (f : nat -> nat -> R) :
  sum m (fun a => sum n (fun b => f a b)) = sum n (fun b => sum m (fun a => f a b)).
Proof.
  induction m as [|m IH]; simpl.
  - rewrite sum_const. lra.
  - rewrite IH, <- sum_add. reflexivity.
Qed.

(** * Euclidean norm and Cauchy-Schwarz *)

Lemma sum_sq_nonneg d v : 0 <= sum d (fun i => v i ^ 2).
Proof. apply sum_nonneg. intros. apply pow2_ge_0. Qed.

Lemma norm_nonneg d v : 0 <= norm d v.
Proof. apply sqrt_pos. Qed.

(** Lagrange's identity: the Cauchy-Schwarz gap is a sum of squares. *)
Lemma lagrange_inner d u v i :
  sum d (fun j => (u i * v j - u j * v i) ^ 2)
  = u i ^ 2 * sum d (fun j => v j ^ 2) + v i ^ 2 * sum d (fun j => u j ^ 2)
    - 2 * (u i * v i) * sum d (fun j => u j * v j).
Proof.
  rewrite <- !sum_scal_l, <- sum_add, <- sum_sub. apply sum_ext. intros. ring.
Qed.

Lemma lagrange d u v :
  sum d (fun i => sum d (fun j => (u i * v j - u j * v i) ^ 2))
  = 2 * (sum d (fun i => u i ^ 2) * sum d (fun i => v i ^ 2)
         - sum d (fun i => u i * v i) ^ 2).
Proof.
  rewrite (sum_ext d _ _ (fun i _ => lagrange_inner d u v i)).
  rewrite sum_sub, sum_add, !sum_scal_r.
  rewrite (sum_scal_l d 2 (fun j => u j * v j)). ring.
Qed.

Lemma cauchy_schwarz_sq d u v :
  sum d (fun i => u i * v i) ^ 2
  <= sum d (fun i => u i ^ 2) * sum d (fun i => v i ^ 2).
Proof.
  assert (H : 0 <= sum d (fun i => sum d (fun j => (u i * v j - u j * v i) ^ 2))).
  { apply sum_nonneg. intros. apply sum_sq_nonneg. }
  rewrite lagrange in H. lra.
Qed.

Lemma cauchy_schwarz_abs d u v :
  Rabs (sum d (fun i => u i * v i)) <= norm d u * norm d v.
Proof.
  unfold norm. rewrite <- sqrt_mult_alt by apply sum_sq_nonneg.
  rewrite <- (sqrt_pow2 (Rabs (sum d (fun i => u i * v i)))) by apply Rabs_pos.
  rewrite pow2_abs.
  apply sqrt_le_1_alt. apply cauchy_schwarz_sq.
Qed.

Lemma cauchy_schwarz d u v :
  sum d (fun i => u i * v i) <= norm d u * norm d v.
Proof. eapply Rle_trans; [apply Rle_abs|apply cauchy_schwarz_abs]. Qed.

(** * Total variation and softmax *)

Lemma tv_sym n p q : tv n p q = tv n q p.
Proof.
  unfold tv. f_equal. apply sum_ext. intros. rewrite Rabs_minus_sym. reflexivity.
Qed.

Lemma tv_nonneg n p q : 0 <= tv n p q.
Proof.
  unfold tv. apply Rmult_le_pos; [lra|]. apply sum_nonneg. intros. apply Rabs_pos.
Qed.

Lemma softmax_sum n x : (0 < n)%nat -> sum n (softmax n x) = 1.
Proof.
  intros Hn. unfold softmax.
  assert (Hz : 0 < sum n (fun i => exp (x i))) by (apply sum_pos; [exact Hn|intros; apply exp_pos]).
  unfold Rdiv. rewrite sum_scal_r. field. lra.
Qed.
