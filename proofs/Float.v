(** T8: floating point. IEEE binary32 is modelled by Flocq's FLT format with 24 bits of
    precision and least exponent -149 ([fmt32], subnormals included), with rounding to
    nearest under any tie-breaking rule [choice] (ties-to-even: [ties_even]).
    The FLT model has no largest exponent: it agrees with binary32 as long as no rounded
    result overflows (for nonnegative sums an overflow gives +inf, against which any
    lower bound holds trivially); the last section checks this against Flocq's
    bit-level binary32 addition.
    Contents: left-to-right sums (the main theorem), sums in any tree order, single
    roundings of products (normal range, and with the 2^-150 subnormal term), fused
    multiply-add accumulation, and the bridge to bit-level binary32.
    Not covered: flush-to-zero arithmetic (subnormals flushed), which breaks the
    subnormal exactness used here. *)
From Coq Require Import Reals Lra Lia.
From Flocq Require Import Core Plus_error Relative.
From Flocq Require IEEE754.BinarySingleNaN.
From KVCert Require Import Prelim.
Open Scope R_scope.

(** The binary32 format and its rounding to nearest. *)
Definition fmt32 : Z -> Z := FLT_exp (-149) 24.

Definition rn32 (choice : Z -> bool) (x : R) : R :=
  round radix2 fmt32 (Znearest choice) x.

Definition is_f32 (x : R) : Prop := generic_format radix2 fmt32 x.

(** Unit roundoff of binary32 and the classical [gamma_n] of Higham, ch. 3. *)
Definition u32 : R := / 2 ^ 24.

Definition gamma32 (n : nat) : R := INR n * u32 / (1 - INR n * u32).

(** Recursive (left-to-right) floating-point sum: s_0 = 0, s_{k+1} = rn(s_k + a_k). *)
Fixpoint fsum (choice : Z -> bool) (n : nat) (a : nat -> R) : R :=
  match n with
  | O => 0
  | S m => rn32 choice (fsum choice m a + a m)
  end.

Lemma u32_pos : 0 < u32.
Proof. unfold u32. apply Rinv_0_lt_compat. apply pow_lt. lra. Qed.

Lemma u32_lt_1 : u32 < 1.
Proof. unfold u32. simpl. lra. Qed.

Lemma u_ro_radix2_24 : u_ro radix2 24 = u32.
Proof.
  unfold u_ro, u32. simpl bpow.
  replace (Z.pow_pos 2 23) with 8388608%Z by reflexivity. simpl. lra.
Qed.

Lemma prec32_gt_0 : Prec_gt_0 24.
Proof. unfold Prec_gt_0. lia. Qed.

Lemma is_f32_rn32 choice x : is_f32 (rn32 choice x).
Proof.
  unfold is_f32, rn32. apply generic_format_round.
  - unfold fmt32. apply FLT_exp_valid. reflexivity.
  - apply valid_rnd_N.
Qed.

Lemma div_mul_cancel x y : y <> 0 -> x / y * y = x.
Proof. intros. field. exact H. Qed.

Lemma is_f32_0 : is_f32 0.
Proof. apply generic_format_0. Qed.

(** One rounded addition of two nonnegative floats loses at most a factor 1 - u, also
    in the subnormal range (where the sum of two floats is exact). *)
Lemma rn32_plus_ge_of_nonneg choice x y :
  is_f32 x -> is_f32 y -> 0 <= x -> 0 <= y ->
  (1 - u32) * (x + y) <= rn32 choice (x + y).
Proof.
  intros Fx Fy Hx Hy.
  destruct (@FLT_plus_error_N_ex radix2 (-149) 24 prec32_gt_0 choice x y Fx Fy)
    as [eps [Heps Hr]].
  unfold rn32, fmt32. rewrite Hr.
  rewrite u_ro_radix2_24 in Heps.
  assert (Hu : u32 / (1 + u32) <= u32).
  { pose proof u32_pos. apply Rmult_le_reg_r with (1 + u32); [lra|].
    rewrite div_mul_cancel by lra. nra. }
  assert (He : - u32 <= eps) by (apply Rabs_le_inv in Heps; lra).
  nra.
Qed.

Lemma pow_le_1_of x n : 0 <= x <= 1 -> x ^ n <= 1.
Proof.
  intros Hx. induction n as [|n IH]; simpl; [lra|].
  assert (0 <= x ^ n) by (apply pow_le; lra). nra.
Qed.

Lemma fsum_f32 choice n a : is_f32 (fsum choice n a).
Proof. destruct n; simpl; [apply is_f32_0|apply is_f32_rn32]. Qed.

(** Main induction: s_n >= (1 - u)^n * (a_0 + ... + a_{n-1}). *)
Lemma pow_one_minus_u_sum_le_fsum choice n a :
  (forall j, (j < n)%nat -> is_f32 (a j) /\ 0 <= a j) ->
  (1 - u32) ^ n * sum n a <= fsum choice n a.
Proof.
  pose proof u32_pos as Hu0. pose proof u32_lt_1 as Hu1.
  induction n as [|n IH]; intros Ha; simpl; [lra|].
  assert (IH' : (1 - u32) ^ n * sum n a <= fsum choice n a)
    by (apply IH; intros; apply Ha; lia).
  destruct (Ha n ltac:(lia)) as [Fa Ha0].
  assert (Hsum : 0 <= sum n a)
    by (apply sum_nonneg; intros j Hj; apply Ha; lia).
  assert (Hp0 : 0 <= (1 - u32) ^ n) by (apply pow_le; lra).
  assert (Hp1 : (1 - u32) ^ n <= 1) by (apply pow_le_1_of; lra).
  assert (Hs0 : 0 <= fsum choice n a) by nra.
  pose proof (rn32_plus_ge_of_nonneg choice _ _ (fsum_f32 choice n a) Fa Hs0 Ha0).
  assert ((1 - u32) ^ n * a n <= a n) by nra.
  nra.
Qed.

(** Bernoulli: (1 - u)^n >= 1 - n u for 0 <= u <= 1. *)
Lemma one_minus_n_mul_le_pow n x : 0 <= x <= 1 -> 1 - INR n * x <= (1 - x) ^ n.
Proof.
  intros Hx. induction n as [|n IH]; [simpl; lra|].
  rewrite S_INR. simpl pow.
  assert (0 <= INR n) by apply pos_INR.
  assert ((1 - INR n * x) * (1 - x) <= (1 - x) * (1 - x) ^ n) by nra.
  nra.
Qed.

(** The product form, valid whenever n u < 1. *)
Lemma one_minus_gamma_mul_sum_le_fsum choice n a :
  INR n * u32 < 1 ->
  (forall j, (j < n)%nat -> is_f32 (a j) /\ 0 <= a j) ->
  (1 - gamma32 n) * sum n a <= fsum choice n a.
Proof.
  intros Hn Ha. pose proof u32_pos. pose proof u32_lt_1.
  assert (Hsum : 0 <= sum n a) by (apply sum_nonneg; intros j Hj; apply Ha; lia).
  assert (Hg : INR n * u32 <= gamma32 n).
  { unfold gamma32. assert (0 <= INR n) by apply pos_INR.
    apply Rmult_le_reg_r with (1 - INR n * u32); [lra|].
    rewrite div_mul_cancel by lra. nra. }
  pose proof (one_minus_n_mul_le_pow n u32 ltac:(lra)).
  pose proof (pow_one_minus_u_sum_le_fsum choice n a Ha).
  nra.
Qed.

(** What it buys: an fp32 kernel that adds n nonnegative fp32 terms left to right with
    round-to-nearest may report [s_n / (1 - gamma_n)] as a sound upper bound on the exact
    sum, for any n < 2^23 (so that gamma_n < 1), subnormals included. *)
Theorem exact_sum_le_computed_div_of_nonneg choice n a :
  2 * (INR n * u32) < 1 ->
  (forall j, (j < n)%nat -> is_f32 (a j) /\ 0 <= a j) ->
  sum n a <= fsum choice n a / (1 - gamma32 n).
Proof.
  intros Hn Ha. pose proof u32_pos.
  assert (0 <= INR n) by apply pos_INR.
  assert (Hg : gamma32 n < 1).
  { unfold gamma32. apply Rmult_lt_reg_r with (1 - INR n * u32); [lra|].
    rewrite div_mul_cancel by lra. lra. }
  pose proof (one_minus_gamma_mul_sum_le_fsum choice n a ltac:(lra) Ha).
  apply Rmult_le_reg_r with (1 - gamma32 n); [lra|].
  rewrite div_mul_cancel by lra. lra.
Qed.

(** * Summation in any order (pairwise, blocked, GPU tree reductions) *)

(** A summation tree: each [Node] is one rounded fp32 addition. *)
Inductive stree : Type :=
  | Leaf (x : R)
  | Node (l r : stree).

Fixpoint exact_tree (t : stree) : R :=
  match t with
  | Leaf x => x
  | Node l r => exact_tree l + exact_tree r
  end.

Fixpoint ftree (choice : Z -> bool) (t : stree) : R :=
  match t with
  | Leaf x => x
  | Node l r => rn32 choice (ftree choice l + ftree choice r)
  end.

Fixpoint leaves_nonneg_f32 (t : stree) : Prop :=
  match t with
  | Leaf x => is_f32 x /\ 0 <= x
  | Node l r => leaves_nonneg_f32 l /\ leaves_nonneg_f32 r
  end.

Fixpoint depth (t : stree) : nat :=
  match t with
  | Leaf _ => O
  | Node l r => S (Nat.max (depth l) (depth r))
  end.

Fixpoint size (t : stree) : nat :=
  match t with
  | Leaf _ => 1
  | Node l r => size l + size r
  end.

Lemma depth_lt_size t : (depth t < size t)%nat.
Proof. induction t as [x|l IHl r IHr]; simpl; lia. Qed.

Lemma pow_le_pow_of_le x m n : 0 <= x <= 1 -> (m <= n)%nat -> x ^ n <= x ^ m.
Proof.
  intros Hx Hmn. replace n with (m + (n - m))%nat by lia.
  rewrite pow_add.
  assert (0 <= x ^ m) by (apply pow_le; lra).
  assert (0 <= x ^ (n - m)) by (apply pow_le; lra).
  assert (x ^ (n - m) <= 1) by (apply pow_le_1_of; lra).
  nra.
Qed.

Lemma rn32_nonneg_of_nonneg choice x : 0 <= x -> 0 <= rn32 choice x.
Proof.
  intros Hx. unfold rn32. apply round_ge_generic.
  - unfold fmt32. apply FLT_exp_valid. reflexivity.
  - apply valid_rnd_N.
  - apply generic_format_0.
  - exact Hx.
Qed.

Lemma ftree_nonneg_f32 choice t :
  leaves_nonneg_f32 t -> is_f32 (ftree choice t) /\ 0 <= ftree choice t.
Proof.
  induction t as [x|l IHl r IHr]; simpl; [tauto|].
  intros [Hl Hr]. destruct (IHl Hl). destruct (IHr Hr). split.
  - apply is_f32_rn32.
  - apply rn32_nonneg_of_nonneg. lra.
Qed.

Lemma exact_tree_nonneg t : leaves_nonneg_f32 t -> 0 <= exact_tree t.
Proof.
  induction t as [x|l IHl r IHr]; simpl; [tauto|].
  intros [Hl Hr]. specialize (IHl Hl). specialize (IHr Hr). lra.
Qed.

(** Each leaf goes through at most [depth t] rounded additions. *)
Lemma pow_depth_exact_le_ftree choice t :
  leaves_nonneg_f32 t -> (1 - u32) ^ depth t * exact_tree t <= ftree choice t.
Proof.
  pose proof u32_pos as Hu0. pose proof u32_lt_1 as Hu1.
  induction t as [x|l IHl r IHr]; simpl; [lra|].
  intros [Hl Hr].
  specialize (IHl Hl). specialize (IHr Hr).
  destruct (ftree_nonneg_f32 choice l Hl) as [Fl Pl].
  destruct (ftree_nonneg_f32 choice r Hr) as [Fr Pr].
  pose proof (exact_tree_nonneg l Hl). pose proof (exact_tree_nonneg r Hr).
  pose proof (rn32_plus_ge_of_nonneg choice _ _ Fl Fr Pl Pr).
  set (d := Nat.max (depth l) (depth r)).
  assert (Hdl : (1 - u32) ^ d <= (1 - u32) ^ depth l)
    by (apply pow_le_pow_of_le; [lra|lia]).
  assert (Hdr : (1 - u32) ^ d <= (1 - u32) ^ depth r)
    by (apply pow_le_pow_of_le; [lra|lia]).
  assert (0 <= (1 - u32) ^ d) by (apply pow_le; lra).
  assert ((1 - u32) ^ d * (exact_tree l + exact_tree r)
          <= ftree choice l + ftree choice r) by nra.
  nra.
Qed.

(** Product form for any n bounding the depth (e.g. n = number of terms) with n u < 1. *)
Lemma one_minus_gamma_mul_exact_le_ftree choice t n :
  (depth t <= n)%nat -> INR n * u32 < 1 -> leaves_nonneg_f32 t ->
  (1 - gamma32 n) * exact_tree t <= ftree choice t.
Proof.
  intros Hd Hn Ht. pose proof u32_pos. pose proof u32_lt_1.
  pose proof (exact_tree_nonneg t Ht).
  assert (Hg : INR n * u32 <= gamma32 n).
  { unfold gamma32. assert (0 <= INR n) by apply pos_INR.
    apply Rmult_le_reg_r with (1 - INR n * u32); [lra|].
    rewrite div_mul_cancel by lra. nra. }
  pose proof (one_minus_n_mul_le_pow n u32 ltac:(lra)).
  assert ((1 - u32) ^ n <= (1 - u32) ^ depth t) by (apply pow_le_pow_of_le; [lra|lia]).
  pose proof (pow_depth_exact_le_ftree choice t Ht).
  nra.
Qed.

(** Division form for trees: a tree reduction of n nonnegative fp32 terms with any
    shape (its depth is at most n - 1 < n) is covered by the same margin gamma_n. *)
Lemma exact_tree_le_computed_div_of_nonneg choice t n :
  (depth t <= n)%nat -> 2 * (INR n * u32) < 1 -> leaves_nonneg_f32 t ->
  exact_tree t <= ftree choice t / (1 - gamma32 n).
Proof.
  intros Hd Hn Ht. pose proof u32_pos.
  assert (0 <= INR n) by apply pos_INR.
  assert (Hg : gamma32 n < 1).
  { unfold gamma32. apply Rmult_lt_reg_r with (1 - INR n * u32); [lra|].
    rewrite div_mul_cancel by lra. lra. }
  pose proof (one_minus_gamma_mul_exact_le_ftree choice t n Hd ltac:(lra) Ht).
  apply Rmult_le_reg_r with (1 - gamma32 n); [lra|].
  rewrite div_mul_cancel by lra. lra.
Qed.

(** What it buys: the same margin for a reduction in ANY tree order (pairwise, blocked,
    a GPU [tl.sum]) of n nonnegative fp32 terms, which is how torch and Triton sum. *)
Theorem exact_tree_le_computed_div_size_of_nonneg choice t :
  2 * (INR (size t) * u32) < 1 -> leaves_nonneg_f32 t ->
  exact_tree t <= ftree choice t / (1 - gamma32 (size t)).
Proof.
  intros. apply exact_tree_le_computed_div_of_nonneg; [|assumption|assumption].
  pose proof (depth_lt_size t). lia.
Qed.

(** * Products and other single roundings *)

Lemma bpow2_neg (k : positive) : bpow radix2 (Zneg k) = / 2 ^ Pos.to_nat k.
Proof. rewrite bpow_powerRZ. reflexivity. Qed.

(** Any nonnegative real, rounded to binary32: relative error u, plus an absolute error
    of at most half the smallest subnormal (2^-150) that only occurs below 2^-126. *)
Lemma rn32_ge_sub_of_nonneg choice z :
  0 <= z -> (1 - u32) * z - / 2 ^ 150 <= rn32 choice z.
Proof.
  intros Hz.
  destruct (error_N_FLT radix2 (-149) 24 ltac:(lia) choice z)
    as [eps [eta [Heps [Heta [H0 Hr]]]]].
  unfold rn32, fmt32. rewrite Hr.
  fold (u_ro radix2 24) in Heps. rewrite u_ro_radix2_24 in Heps.
  replace (/ 2 * bpow radix2 (-149)) with (/ 2 ^ 150) in Heta
    by (rewrite bpow2_neg; change (Pos.to_nat 149) with 149%nat;
        change 150%nat with (S 149); simpl pow at 2; field).
  apply Rabs_le_inv in Heps. apply Rabs_le_inv in Heta.
  pose proof u32_pos.
  destruct (Rmult_integral _ _ H0) as [E|E]; subst; nra.
Qed.

(** Normal range: for z >= 2^-126 (the least normal binary32), rounding to nearest loses
    at most a factor 1 - u. This is the case of a product x * y of nonnegative floats
    (e.g. ||q_b|| * rho_b) as long as the product does not underflow; below 2^-126 use
    [rn32_ge_sub_of_nonneg]. *)
Lemma rn32_ge_of_normal choice z :
  / 2 ^ 126 <= z -> (1 - u32) * z <= rn32 choice z.
Proof.
  intros Hz.
  assert (Hb : bpow radix2 (-149 + 24 - 1) = / 2 ^ 126)
    by (change (-149 + 24 - 1)%Z with (Zneg 126); rewrite bpow2_neg; reflexivity).
  assert (Hp : 0 < / 2 ^ 126) by (apply Rinv_0_lt_compat, pow_lt; lra).
  destruct (relative_error_N_FLT_ex radix2 (-149) 24 ltac:(lia) choice z)
    as [eps [Heps Hr]].
  { rewrite Hb, Rabs_pos_eq by lra. exact Hz. }
  unfold rn32, fmt32. rewrite Hr.
  fold (u_ro radix2 24) in Heps. rewrite u_ro_radix2_24 in Heps.
  apply Rabs_le_inv in Heps. nra.
Qed.

(** Recursive sum of arbitrary nonnegative reals with one rounding per step: this covers
    fused multiply-add accumulation, acc <- fma(x_k, y_k, acc) = rn(acc + x_k y_k), where
    the terms x_k y_k are exact reals, not floats. Subnormal steps cost 2^-150 each. *)
Lemma fsum_nonneg_of_nonneg choice n a :
  (forall j, (j < n)%nat -> 0 <= a j) -> 0 <= fsum choice n a.
Proof.
  induction n as [|n IH]; intros Ha; simpl; [lra|].
  apply rn32_nonneg_of_nonneg.
  assert (0 <= fsum choice n a) by (apply IH; intros; apply Ha; lia).
  assert (0 <= a n) by (apply Ha; lia). lra.
Qed.

Lemma pow_sum_sub_le_fsum_of_nonneg choice n a :
  (forall j, (j < n)%nat -> 0 <= a j) ->
  (1 - u32) ^ n * sum n a - INR n * / 2 ^ 150 <= fsum choice n a.
Proof.
  pose proof u32_pos as Hu0. pose proof u32_lt_1 as Hu1.
  assert (He : 0 < / 2 ^ 150) by (apply Rinv_0_lt_compat, pow_lt; lra).
  induction n as [|n IH]; intros Ha; [simpl; lra|].
  rewrite S_INR. simpl sum. simpl fsum. simpl pow.
  assert (IH' : (1 - u32) ^ n * sum n a - INR n * / 2 ^ 150 <= fsum choice n a)
    by (apply IH; intros; apply Ha; lia).
  assert (Ha0 : 0 <= a n) by (apply Ha; lia).
  assert (Hs0 : 0 <= fsum choice n a) by (apply fsum_nonneg_of_nonneg; intros; apply Ha; lia).
  assert (Hsum : 0 <= sum n a) by (apply sum_nonneg; intros; apply Ha; lia).
  assert (Hp0 : 0 <= (1 - u32) ^ n) by (apply pow_le; lra).
  assert (Hp1 : (1 - u32) ^ n <= 1) by (apply pow_le_1_of; lra).
  assert (0 <= INR n) by apply pos_INR.
  pose proof (rn32_ge_sub_of_nonneg choice (fsum choice n a + a n) ltac:(lra)).
  assert ((1 - u32) ^ n * a n <= a n) by nra.
  nra.
Qed.

(** Division form for FMA accumulation of n nonnegative exact terms (2 n u < 1). *)
Lemma exact_sum_le_fma_div_of_nonneg choice n a :
  2 * (INR n * u32) < 1 ->
  (forall j, (j < n)%nat -> 0 <= a j) ->
  sum n a <= (fsum choice n a + INR n * / 2 ^ 150) / (1 - gamma32 n).
Proof.
  intros Hn Ha. pose proof u32_pos. pose proof u32_lt_1.
  assert (0 <= INR n) by apply pos_INR.
  assert (Hsum : 0 <= sum n a) by (apply sum_nonneg; exact Ha).
  assert (Hg : INR n * u32 <= gamma32 n).
  { unfold gamma32. apply Rmult_le_reg_r with (1 - INR n * u32); [lra|].
    rewrite div_mul_cancel by lra. nra. }
  assert (Hg1 : gamma32 n < 1).
  { unfold gamma32. apply Rmult_lt_reg_r with (1 - INR n * u32); [lra|].
    rewrite div_mul_cancel by lra. lra. }
  pose proof (one_minus_n_mul_le_pow n u32 ltac:(lra)).
  pose proof (pow_sum_sub_le_fsum_of_nonneg choice n a Ha).
  apply Rmult_le_reg_r with (1 - gamma32 n); [lra|].
  rewrite div_mul_cancel by lra. nra.
Qed.

(** Products rounded one by one, then summed: sum of x_j y_j against the sum of the
    rounded products (each rn(x_j y_j) is a nonnegative float, so the main theorem then
    bounds that sum by the computed one). *)
Lemma sum_mul_le_sum_rn32_of_nonneg choice n x y :
  (forall j, (j < n)%nat -> 0 <= x j * y j) ->
  (1 - u32) * sum n (fun j => x j * y j) - INR n * / 2 ^ 150
    <= sum n (fun j => rn32 choice (x j * y j)).
Proof.
  intros H.
  rewrite <- sum_scal_l.
  replace (INR n * / 2 ^ 150) with (sum n (fun _ => / 2 ^ 150)) by (rewrite sum_const; ring).
  rewrite <- sum_sub. apply sum_le. intros j Hj.
  apply rn32_ge_sub_of_nonneg. apply H. exact Hj.
Qed.

(** Trees whose leaves are arbitrary nonnegative reals (exact products fed to a fused
    multiply-add, rounded products, ...): each of the [nodes t] rounded additions may
    also cost 2^-150 in the subnormal range. *)
Fixpoint leaves_nonneg (t : stree) : Prop :=
  match t with
  | Leaf x => 0 <= x
  | Node l r => leaves_nonneg l /\ leaves_nonneg r
  end.

Fixpoint nodes (t : stree) : nat :=
  match t with
  | Leaf _ => O
  | Node l r => S (nodes l + nodes r)
  end.

Lemma nodes_lt_size t : (nodes t < size t)%nat.
Proof. induction t as [x|l IHl r IHr]; simpl; lia. Qed.

Lemma ftree_nonneg_of_nonneg choice t : leaves_nonneg t -> 0 <= ftree choice t.
Proof.
  induction t as [x|l IHl r IHr]; simpl; [tauto|].
  intros [Hl Hr]. apply rn32_nonneg_of_nonneg.
  specialize (IHl Hl). specialize (IHr Hr). lra.
Qed.

Lemma exact_tree_nonneg_of_nonneg t : leaves_nonneg t -> 0 <= exact_tree t.
Proof.
  induction t as [x|l IHl r IHr]; simpl; [tauto|].
  intros [Hl Hr]. specialize (IHl Hl). specialize (IHr Hr). lra.
Qed.

Lemma pow_depth_exact_sub_le_ftree choice t :
  leaves_nonneg t ->
  (1 - u32) ^ depth t * exact_tree t - INR (nodes t) * / 2 ^ 150 <= ftree choice t.
Proof.
  pose proof u32_pos as Hu0. pose proof u32_lt_1 as Hu1.
  assert (He : 0 < / 2 ^ 150) by (apply Rinv_0_lt_compat, pow_lt; lra).
  induction t as [x|l IHl r IHr]; [simpl; intros; lra|].
  simpl leaves_nonneg. intros [Hl Hr]. cbn [depth nodes exact_tree ftree pow].
  specialize (IHl Hl). specialize (IHr Hr).
  pose proof (ftree_nonneg_of_nonneg choice l Hl).
  pose proof (ftree_nonneg_of_nonneg choice r Hr).
  pose proof (exact_tree_nonneg_of_nonneg l Hl).
  pose proof (exact_tree_nonneg_of_nonneg r Hr).
  pose proof (rn32_ge_sub_of_nonneg choice (ftree choice l + ftree choice r) ltac:(lra)).
  rewrite S_INR, plus_INR.
  assert (0 <= INR (nodes l)) by apply pos_INR.
  assert (0 <= INR (nodes r)) by apply pos_INR.
  set (d := Nat.max (depth l) (depth r)).
  assert (Hdl : (1 - u32) ^ d <= (1 - u32) ^ depth l)
    by (apply pow_le_pow_of_le; [lra|lia]).
  assert (Hdr : (1 - u32) ^ d <= (1 - u32) ^ depth r)
    by (apply pow_le_pow_of_le; [lra|lia]).
  assert (0 <= (1 - u32) ^ d) by (apply pow_le; lra).
  assert ((1 - u32) ^ d * (exact_tree l + exact_tree r)
          - (INR (nodes l) + INR (nodes r)) * / 2 ^ 150
          <= ftree choice l + ftree choice r) by nra.
  assert ((1 - u32) * ((INR (nodes l) + INR (nodes r)) * / 2 ^ 150)
          <= (INR (nodes l) + INR (nodes r)) * / 2 ^ 150) by nra.
  nra.
Qed.

(** Division form for any summation tree of nonnegative reals whose depth is at most n,
    with 2 n u < 1 (for n terms take n itself: depth < size). *)
Lemma exact_tree_le_ftree_sub_div_of_nonneg choice t n :
  (depth t <= n)%nat -> 2 * (INR n * u32) < 1 -> leaves_nonneg t ->
  exact_tree t <= (ftree choice t + INR (nodes t) * / 2 ^ 150) / (1 - gamma32 n).
Proof.
  intros Hd Hn Ht. pose proof u32_pos. pose proof u32_lt_1.
  assert (0 <= INR n) by apply pos_INR.
  pose proof (exact_tree_nonneg_of_nonneg t Ht).
  assert (Hg : INR n * u32 <= gamma32 n).
  { unfold gamma32. apply Rmult_le_reg_r with (1 - INR n * u32); [lra|].
    rewrite div_mul_cancel by lra. nra. }
  assert (Hg1 : gamma32 n < 1).
  { unfold gamma32. apply Rmult_lt_reg_r with (1 - INR n * u32); [lra|].
    rewrite div_mul_cancel by lra. lra. }
  pose proof (one_minus_n_mul_le_pow n u32 ltac:(lra)).
  assert ((1 - u32) ^ n <= (1 - u32) ^ depth t) by (apply pow_le_pow_of_le; [lra|lia]).
  pose proof (pow_depth_exact_sub_le_ftree choice t Ht).
  apply Rmult_le_reg_r with (1 - gamma32 n); [lra|].
  rewrite div_mul_cancel by lra. nra.
Qed.

(** * Bridge to bit-level IEEE binary32 *)

(** Flocq's bit-level binary32 (no NaN payloads) with its IEEE addition, ties-to-even. *)
Definition f32 : Type := BinarySingleNaN.binary_float 24 128.

Definition b2r (x : f32) : R := BinarySingleNaN.B2R x.

Definition finite32 (x : f32) : Prop := BinarySingleNaN.is_finite x = true.

Definition bplus32 (x y : f32) : f32 :=
  @BinarySingleNaN.Bplus 24 128 eq_refl eq_refl BinarySingleNaN.mode_NE x y.

(** Left-to-right binary32 sum, starting from +0. *)
Fixpoint bsum (n : nat) (a : nat -> f32) : f32 :=
  match n with
  | O => BinarySingleNaN.B754_zero false
  | S m => bplus32 (bsum m a) (a m)
  end.

Definition ties_even : Z -> bool := fun k => negb (Z.even k).

Lemma is_f32_b2r x : is_f32 (b2r x).
Proof. apply BinarySingleNaN.generic_format_B2R. Qed.

Lemma finite32_bplus32_l x y : finite32 (bplus32 x y) -> finite32 x.
Proof.
  unfold finite32, bplus32.
  destruct x as [sx|sx| |sx mx ex Hx]; destruct y as [sy|sy| |sy my ey Hy];
    simpl; try easy.
  destruct (Bool.eqb sx sy); easy.
Qed.

(** A finite IEEE sum of two finite floats is the rounded real sum. *)
Lemma b2r_bplus32_of_finite x y :
  finite32 x -> finite32 y -> finite32 (bplus32 x y) ->
  b2r (bplus32 x y) = rn32 ties_even (b2r x + b2r y).
Proof.
  intros Fx Fy Fs.
  pose proof (@BinarySingleNaN.Bplus_correct 24 128 eq_refl eq_refl
                BinarySingleNaN.mode_NE x y Fx Fy) as H.
  destruct Rlt_bool.
  - destruct H as [H _]. exact H.
  - destruct H as [H _]. exfalso.
    unfold finite32, bplus32 in Fs.
    rewrite <- BinarySingleNaN.is_finite_SF_B2SF, H in Fs. discriminate Fs.
Qed.

Lemma b2r_bsum_of_finite n a :
  (forall j, (j < n)%nat -> finite32 (a j)) -> finite32 (bsum n a) ->
  b2r (bsum n a) = fsum ties_even n (fun j => b2r (a j)).
Proof.
  induction n as [|n IH]; intros Ha Fs; simpl; [reflexivity|].
  simpl in Fs.
  pose proof (finite32_bplus32_l _ _ Fs) as Fm.
  rewrite b2r_bplus32_of_finite; [|exact Fm|apply Ha; lia|exact Fs].
  rewrite IH; [reflexivity| |exact Fm].
  intros; apply Ha; lia.
Qed.

(** The main theorem for the bit-level IEEE binary32 sum: whenever the computed sum is
    finite (an overflow yields +inf, against which the bound is trivial). *)
Lemma exact_sum_le_bsum_div_of_nonneg n a :
  2 * (INR n * u32) < 1 ->
  (forall j, (j < n)%nat -> finite32 (a j) /\ 0 <= b2r (a j)) ->
  finite32 (bsum n a) ->
  sum n (fun j => b2r (a j)) <= b2r (bsum n a) / (1 - gamma32 n).
Proof.
  intros Hn Ha Fs.
  rewrite b2r_bsum_of_finite; [|intros; apply Ha; assumption|exact Fs].
  apply exact_sum_le_computed_div_of_nonneg; [exact Hn|].
  intros j Hj. split; [apply is_f32_b2r|apply Ha; exact Hj].
Qed.
