From KVCert Require Import Prelim Box.
From Coq Require Import Reals Lra Lia Arith.
Open Scope R_scope.

(** The box form over pseudo-tokens: tokens grouped by a map [b] into [M] bins whose members share
    their interval ([lo j = LO (b j)], [hi j = HI (b j)], e.g. c_j rounded up to a grid value), each
    bin's enclosure a lower bound of its members' [ql] and an upper bound of their [qh]: box_e over
    the bins bounds box_e over the tokens, so Box.v's certificate holds over the bins. *)

Lemma sum_pick_none M k c : (M <= k)%nat -> sum M (fun m => if Nat.eqb k m then c else 0) = 0.
Proof.
  induction M as [|M IH]; intros H; simpl; [reflexivity|].
  rewrite IH by lia. destruct (Nat.eqb_spec k M); [lia|ring].
Qed.

Lemma sum_pick M k c : (k < M)%nat -> sum M (fun m => if Nat.eqb k m then c else 0) = c.
Proof.
  induction M as [|M IH]; intros H; [lia|]. simpl.
  destruct (Nat.eqb_spec k M) as [->|Hne].
  - rewrite sum_pick_none by lia. ring.
  - rewrite IH by lia. ring.
Qed.

Lemma sum_fibers n M (b : nat -> nat) f :
  (forall j, (j < n)%nat -> (b j < M)%nat) ->
  sum n f = sum M (fun m => sum n (fun j => if Nat.eqb (b j) m then f j else 0)).
Proof.
  intros Hb. rewrite sum_swap. apply sum_ext. intros j Hj. symmetry. apply sum_pick, Hb, Hj.
Qed.

Theorem box_e_merge n M (b : nat -> nat) ql qh lo hi QL QH LO HI u lam :
  0 <= u -> 0 <= lam ->
  (forall j, (j < n)%nat -> (b j < M)%nat /\ lo j = LO (b j) /\ hi j = HI (b j)) ->
  (forall m, (m < M)%nat -> QL m <= sum n (fun j => if Nat.eqb (b j) m then ql j else 0)) ->
  (forall m, (m < M)%nat -> sum n (fun j => if Nat.eqb (b j) m then qh j else 0) <= QH m) ->
  box_e n ql qh lo hi u lam <= box_e M QL QH LO HI u lam.
Proof.
  intros Hu Hl Hb HQL HQH. unfold box_e.
  assert (HbM : forall j, (j < n)%nat -> (b j < M)%nat) by (intros j Hj; apply (Hb j Hj)).
  rewrite (sum_fibers n M b (fun j => ql j * exp (lo j)) HbM).
  rewrite (sum_fibers n M b (fun j => qh j * Rmax 0 (kappa lo hi u lam j)) HbM).
  assert (E1 : forall m, (m < M)%nat ->
            sum n (fun j => if Nat.eqb (b j) m then ql j * exp (lo j) else 0)
            = sum n (fun j => if Nat.eqb (b j) m then ql j else 0) * exp (LO m)).
  { intros m Hm. rewrite <- sum_scal_r. apply sum_ext. intros j Hj.
    destruct (Nat.eqb_spec (b j) m) as [Heq|_]; [|ring].
    destruct (Hb j Hj) as [_ [Hlo _]]. rewrite Hlo, Heq. reflexivity. }
  assert (E2 : forall m, (m < M)%nat ->
            sum n (fun j => if Nat.eqb (b j) m then qh j * Rmax 0 (kappa lo hi u lam j) else 0)
            = sum n (fun j => if Nat.eqb (b j) m then qh j else 0) * Rmax 0 (kappa LO HI u lam m)).
  { intros m Hm. rewrite <- sum_scal_r. apply sum_ext. intros j Hj.
    destruct (Nat.eqb_spec (b j) m) as [Heq|_]; [|ring].
    destruct (Hb j Hj) as [_ [Hlo Hhi]]. unfold kappa. rewrite Hlo, Hhi, Heq. reflexivity. }
  rewrite (sum_ext M _ _ E1), (sum_ext M _ _ E2).
  assert (sum M (fun m => QL m * exp (LO m)) <= sum M (fun m => sum n (fun j => if Nat.eqb (b j) m then ql j else 0) * exp (LO m))).
  { apply sum_le. intros m Hm. apply Rmult_le_compat_r; [left; apply exp_pos|apply HQL, Hm]. }
  assert (sum M (fun m => sum n (fun j => if Nat.eqb (b j) m then qh j else 0) * Rmax 0 (kappa LO HI u lam m))
          <= sum M (fun m => QH m * Rmax 0 (kappa LO HI u lam m))).
  { apply sum_le. intros m Hm. apply Rmult_le_compat_r; [apply Rmax_l|apply HQH, Hm]. }
  assert (0 <= lam * u) by nra. nra.
Qed.
