(** T3: RoPE band unitarity. A rotation preserves norms and inner products, so the
    norm of every band (a union of rotation pairs) is the same at every position, and
    the query-key score depends only on the offset between the two positions.
    Both layouts are covered: HF "rotate_half" (pairs (i, i+P), head dim D = 2P)
    and interleaved (pairs (2i, 2i+1)). *)
From KVCert Require Import Prelim.
From Coq Require Import Reals Lra Lia List.
Open Scope R_scope.

(** * Plane rotations *)

Lemma cos2_sin2 a : cos a ^ 2 + sin a ^ 2 = 1.
Proof. rewrite <- (sin2_cos2 a). unfold Rsqr. ring. Qed.

(** A rotation never changes the length of a 2-D vector, so a norm bound taken
    before rotation holds after it. *)
Theorem rotate_norm_eq c s x y :
  c ^ 2 + s ^ 2 = 1 ->
  (c * x - s * y) ^ 2 + (s * x + c * y) ^ 2 = x ^ 2 + y ^ 2.
Proof.
  intros H.
  transitivity ((c ^ 2 + s ^ 2) * (x ^ 2 + y ^ 2)); [ring|].
  rewrite H. ring.
Qed.

(** Rotating two 2-D vectors by the same angle keeps their inner product, so
    scores computed on rotated pairs equal scores on unrotated ones. *)
Theorem rotate_inner_eq c s x1 y1 x2 y2 :
  c ^ 2 + s ^ 2 = 1 ->
  (c * x1 - s * y1) * (c * x2 - s * y2) + (s * x1 + c * y1) * (s * x2 + c * y2)
  = x1 * x2 + y1 * y2.
Proof.
  intros H.
  transitivity ((c ^ 2 + s ^ 2) * (x1 * x2 + y1 * y2)); [ring|].
  rewrite H. ring.
Qed.

(** Rotating by a and by b: the inner product equals rotating only the second
    vector by b - a. *)
Lemma rotate_inner_relative a b x1 y1 x2 y2 :
  (x1 * cos a - y1 * sin a) * (x2 * cos b - y2 * sin b)
  + (y1 * cos a + x1 * sin a) * (y2 * cos b + x2 * sin b)
  = x1 * (x2 * cos (b - a) - y2 * sin (b - a))
    + y1 * (y2 * cos (b - a) + x2 * sin (b - a)).
Proof. rewrite cos_minus, sin_minus. ring. Qed.

Lemma rotate_sq_eq a x y :
  (x * cos a - y * sin a) ^ 2 + (y * cos a + x * sin a) ^ 2 = x ^ 2 + y ^ 2.
Proof.
  rewrite <- (rotate_norm_eq (cos a) (sin a) x y (cos2_sin2 a)). ring.
Qed.

(** * Finite sums split into pairs *)

Lemma sum_pairs_half P f :
  sum (2 * P) f = sum P (fun i => f i + f (i + P)%nat).
Proof.
  replace (2 * P)%nat with (P + P)%nat by lia.
  rewrite sum_split, sum_add. f_equal. apply sum_ext. intros. f_equal. lia.
Qed.

Lemma sum_pairs_interleaved P f :
  sum (2 * P) f = sum P (fun i => f (2 * i)%nat + f (S (2 * i))).
Proof.
  induction P as [|P IH]; [reflexivity|].
  replace (2 * S P)%nat with (S (S (2 * P))) by lia.
  change (sum (S (S (2 * P))) f) with (sum (2 * P) f + f (2 * P)%nat + f (S (2 * P))).
  change (sum (S P) (fun i => f (2 * i)%nat + f (S (2 * i))))
    with (sum P (fun i => f (2 * i)%nat + f (S (2 * i))) + (f (2 * P)%nat + f (S (2 * P)))).
  rewrite IH. lra.
Qed.

(** * The two RoPE layouts *)

(** rotate_half layout (HF): pair i < P is (i, i + P), rotated by angle m * theta i. *)
Definition rope_half (P : nat) (theta : nat -> R) (m : R) (x : nat -> R) (j : nat) : R :=
  if (j <? P)%nat
  then x j * cos (m * theta j) - x (j + P)%nat * sin (m * theta j)
  else x j * cos (m * theta (j - P)%nat) + x (j - P)%nat * sin (m * theta (j - P)%nat).

(** Interleaved layout: pair i is (2i, 2i+1), rotated by angle m * theta i. *)
Definition rope_inter (theta : nat -> R) (m : R) (x : nat -> R) (j : nat) : R :=
  if Nat.even j
  then x j * cos (m * theta (Nat.div2 j)) - x (S j) * sin (m * theta (Nat.div2 j))
  else x j * cos (m * theta (Nat.div2 j)) + x (pred j) * sin (m * theta (Nat.div2 j)).

Lemma rope_half_lo P theta m x i :
  (i < P)%nat ->
  rope_half P theta m x i = x i * cos (m * theta i) - x (i + P)%nat * sin (m * theta i).
Proof.
  intros H. unfold rope_half. destruct (Nat.ltb_spec i P); [reflexivity|lia].
Qed.

Lemma rope_half_hi P theta m x i :
  rope_half P theta m x (i + P) = x (i + P)%nat * cos (m * theta i) + x i * sin (m * theta i).
Proof.
  unfold rope_half. destruct (Nat.ltb_spec (i + P) P); [lia|].
  replace (i + P - P)%nat with i by lia. reflexivity.
Qed.

Lemma even_double i : Nat.even (2 * i) = true.
Proof. rewrite Nat.even_mul. reflexivity. Qed.

Lemma even_succ_double i : Nat.even (S (2 * i)) = false.
Proof. rewrite Nat.even_succ, Nat.odd_mul. reflexivity. Qed.

Lemma rope_inter_even theta m x i :
  rope_inter theta m x (2 * i) =
  x (2 * i)%nat * cos (m * theta i) - x (S (2 * i)) * sin (m * theta i).
Proof. unfold rope_inter. rewrite even_double, Nat.div2_double. reflexivity. Qed.

Lemma rope_inter_odd theta m x i :
  rope_inter theta m x (S (2 * i)) =
  x (S (2 * i)) * cos (m * theta i) + x (2 * i)%nat * sin (m * theta i).
Proof.
  unfold rope_inter. rewrite even_succ_double, Nat.div2_succ_double. reflexivity.
Qed.

(** * Band norms *)

(** A band is a list of pair indices; its squared norm sums both coordinates of
    each listed pair. *)
Definition band_sq_half (P : nat) (b : list nat) (x : nat -> R) : R :=
  fold_right (fun i acc => x i ^ 2 + x (i + P)%nat ^ 2 + acc) 0 b.

Definition band_norm_half (P : nat) (b : list nat) (x : nat -> R) : R :=
  sqrt (band_sq_half P b x).

Definition band_sq_inter (b : list nat) (x : nat -> R) : R :=
  fold_right (fun i acc => x (2 * i)%nat ^ 2 + x (S (2 * i)) ^ 2 + acc) 0 b.

Definition band_norm_inter (b : list nat) (x : nat -> R) : R :=
  sqrt (band_sq_inter b x).

Lemma band_sq_half_cons P i b x :
  band_sq_half P (i :: b) x = x i ^ 2 + x (i + P)%nat ^ 2 + band_sq_half P b x.
Proof. reflexivity. Qed.

Lemma band_sq_inter_cons i b x :
  band_sq_inter (i :: b) x = x (2 * i)%nat ^ 2 + x (S (2 * i)) ^ 2 + band_sq_inter b x.
Proof. reflexivity. Qed.

Lemma band_sq_rope_half_eq P theta m b x :
  Forall (fun i => (i < P)%nat) b ->
  band_sq_half P b (rope_half P theta m x) = band_sq_half P b x.
Proof.
  induction b as [|i b IH]; intros Hb; [reflexivity|].
  inversion Hb as [|? ? Hi Hb']; subst. rewrite !band_sq_half_cons.
  rewrite IH by exact Hb'.
  rewrite rope_half_lo by exact Hi. rewrite rope_half_hi.
  rewrite rotate_sq_eq. reflexivity.
Qed.

Lemma band_sq_rope_inter_eq theta m b x :
  band_sq_inter b (rope_inter theta m x) = band_sq_inter b x.
Proof.
  induction b as [|i b IH]; [reflexivity|]. rewrite !band_sq_inter_cons.
  rewrite IH, rope_inter_even, rope_inter_odd.
  rewrite rotate_sq_eq. reflexivity.
Qed.

(** In the rotate_half layout, the norm of any band of whole pairs is the same at
    every position, so a band witness computed once stays valid at every read. *)
Theorem band_norm_rope_eq_rotate_half P theta m b x :
  Forall (fun i => (i < P)%nat) b ->
  band_norm_half P b (rope_half P theta m x) = band_norm_half P b x.
Proof.
  intros Hb. unfold band_norm_half. rewrite band_sq_rope_half_eq by exact Hb.
  reflexivity.
Qed.

(** In the interleaved layout, the norm of any band of whole pairs is the same at
    every position, so a band witness computed once stays valid at every read. *)
Theorem band_norm_rope_eq_interleaved theta m b x :
  band_norm_inter b (rope_inter theta m x) = band_norm_inter b x.
Proof.
  unfold band_norm_inter. rewrite band_sq_rope_inter_eq. reflexivity.
Qed.

(** * Relative positions *)

(** The RoPE score of a query at position m and a key at position n equals the
    score of the unrotated query with the key rotated by n - m, so it depends only
    on the offset. *)
Theorem inner_rope_eq_relative P theta (m n : R) (q k : nat -> R) :
  sum (2 * P) (fun j => rope_half P theta m q j * rope_half P theta n k j)
  = sum (2 * P) (fun j => q j * rope_half P theta (n - m) k j).
Proof.
  rewrite !sum_pairs_half. apply sum_ext. intros i Hi.
  rewrite !(rope_half_lo P theta _ _ i Hi), !rope_half_hi.
  replace ((n - m) * theta i) with (n * theta i - m * theta i) by ring.
  apply rotate_inner_relative.
Qed.

(** The same offset-only dependence in the interleaved layout (pairs (2i, 2i+1)). *)
Theorem inner_rope_eq_relative_interleaved P theta (m n : R) (q k : nat -> R) :
  sum (2 * P) (fun j => rope_inter theta m q j * rope_inter theta n k j)
  = sum (2 * P) (fun j => q j * rope_inter theta (n - m) k j).
Proof.
  rewrite !sum_pairs_interleaved. apply sum_ext. intros i _.
  rewrite !rope_inter_even, !rope_inter_odd.
  replace ((n - m) * theta i) with (n * theta i - m * theta i) by ring.
  apply rotate_inner_relative.
Qed.
