(** Shared vocabulary of the kvcert development: finite sums over indices 0..n-1,
    total variation and softmax. Vectors and distributions are functions [nat -> R]
    read on their first n indices. *)
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
