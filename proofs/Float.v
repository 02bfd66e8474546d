(** T8: floating point. A binary format with [prec] bits of precision and least exponent
    [emin] (the smallest subnormal is 2^emin) is modelled by Flocq's FLT format
    [FLT_exp emin prec], subnormals included, with rounding to nearest under any
    tie-breaking rule [choice] (ties-to-even: [ties_even]). Its unit roundoff is
    u = 2^-prec. IEEE binary32 is emin = -149, prec = 24; binary64 is emin = -1074, prec = 53.
    The FLT model has no largest exponent: it agrees with IEEE arithmetic as long as no
    rounded result overflows (for nonnegative sums an overflow gives +inf, against which
    any lower bound holds trivially); the last section checks this against Flocq's
    bit-level IEEE addition.
    Contents: everything is proved once for a general format (section [Format]): left-to-right
    sums, sums in any tree order, single roundings of products (normal range, and with the
    subnormal term 2^(emin-1)), fused multiply-add accumulation. Then the main theorems are
    instantiated to binary32 (the GPU kernels) and binary64 (the CPU fast path), and the
    bit-level bridge is proved for any IEEE format and instantiated to both.
    Not covered: flush-to-zero arithmetic (subnormals flushed), which breaks the
    subnormal exactness used here. *)
From Coq Require Import Reals Lra Lia.
From Flocq Require Import Core Plus_error Relative.
From Flocq Require IEEE754.BinarySingleNaN.
From KVCert Require Import Prelim.
Open Scope R_scope.

(** * Real-number facts used below *)

Lemma div_mul_cancel x y : y <> 0 -> x / y * y = x.
Proof. intros. field. exact H. Qed.

Lemma pow_le_1_of x n : 0 <= x <= 1 -> x ^ n <= 1.
Proof.
  intros Hx. induction n as [|n IH]; simpl; [lra|].
  assert (0 <= x ^ n) by (apply pow_le; lra). nra.
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

Lemma pow_le_pow_of_le x m n : 0 <= x <= 1 -> (m <= n)%nat -> x ^ n <= x ^ m.
Proof.
  intros Hx Hmn. replace n with (m + (n - m))%nat by lia.
  rewrite pow_add.
  assert (0 <= x ^ m) by (apply pow_le; lra).
  assert (0 <= x ^ (n - m)) by (apply pow_le; lra).
  assert (x ^ (n - m) <= 1) by (apply pow_le_1_of; lra).
  nra.
Qed.

Lemma bpow2_neg (k : positive) : bpow radix2 (Zneg k) = / 2 ^ Pos.to_nat k.
Proof. rewrite bpow_powerRZ. reflexivity. Qed.

(** * Summation trees (pairwise, blocked, GPU tree reductions) *)

(** A summation tree: in a format, each [Node] is one rounded addition. *)
Inductive stree : Type :=
  | Leaf (x : R)
  | Node (l r : stree).

Fixpoint exact_tree (t : stree) : R :=
  match t with
  | Leaf x => x
  | Node l r => exact_tree l + exact_tree r
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

Fixpoint nodes (t : stree) : nat :=
  match t with
  | Leaf _ => O
  | Node l r => S (nodes l + nodes r)
  end.

Fixpoint leaves_nonneg (t : stree) : Prop :=
  match t with
  | Leaf x => 0 <= x
  | Node l r => leaves_nonneg l /\ leaves_nonneg r
  end.

Lemma depth_lt_size t : (depth t < size t)%nat.
Proof. induction t as [x|l IHl r IHr]; simpl; lia. Qed.

Lemma nodes_lt_size t : (nodes t < size t)%nat.
Proof. induction t as [x|l IHl r IHr]; simpl; lia. Qed.

Lemma exact_tree_nonneg_of_nonneg t : leaves_nonneg t -> 0 <= exact_tree t.
Proof.
  induction t as [x|l IHl r IHr]; simpl; [tauto|].
  intros [Hl Hr]. specialize (IHl Hl). specialize (IHr Hr). lra.
Qed.

(** * Any binary format FLT_exp emin prec *)

Section Format.

Variables emin prec : Z.
Hypothesis prec_gt_0_ : Prec_gt_0 prec.

Definition rn_fmt (choice : Z -> bool) (x : R) : R :=
  round radix2 (FLT_exp emin prec) (Znearest choice) x.

Definition is_fmt (x : R) : Prop := generic_format radix2 (FLT_exp emin prec) x.

(** Unit roundoff u = 2^-prec and the classical [gamma_n] of Higham, ch. 3. *)
Definition u_fmt : R := bpow radix2 (- prec).

Definition gamma_fmt (n : nat) : R := INR n * u_fmt / (1 - INR n * u_fmt).

(** Half the smallest subnormal: the absolute error of a rounding below the normal range. *)
Definition eta_fmt : R := / 2 * bpow radix2 emin.

(** Recursive (left-to-right) floating-point sum: s_0 = 0, s_{k+1} = rn(s_k + a_k). *)
Fixpoint fsum_fmt (choice : Z -> bool) (n : nat) (a : nat -> R) : R :=
  match n with
  | O => 0
  | S m => rn_fmt choice (fsum_fmt choice m a + a m)
  end.

Fixpoint ftree_fmt (choice : Z -> bool) (t : stree) : R :=
  match t with
  | Leaf x => x
  | Node l r => rn_fmt choice (ftree_fmt choice l + ftree_fmt choice r)
  end.

Fixpoint leaves_nonneg_fmt (t : stree) : Prop :=
  match t with
  | Leaf x => is_fmt x /\ 0 <= x
  | Node l r => leaves_nonneg_fmt l /\ leaves_nonneg_fmt r
  end.

Lemma u_fmt_pos : 0 < u_fmt.
Proof. apply bpow_gt_0. Qed.

Lemma u_fmt_lt_1 : u_fmt < 1.
Proof.
  unfold u_fmt. apply Rlt_le_trans with (bpow radix2 0); [|simpl; lra].
  apply bpow_lt. unfold Prec_gt_0 in prec_gt_0_. lia.
Qed.

Lemma u_ro_eq : u_ro radix2 prec = u_fmt.
Proof.
  unfold u_ro, u_fmt. rewrite bpow_plus, bpow_1. simpl (IZR (radix_val radix2)). field.
Qed.

Lemma mul_u_le_gamma_of_lt_1 n : INR n * u_fmt < 1 -> INR n * u_fmt <= gamma_fmt n.
Proof.
  intros Hn. pose proof u_fmt_pos. assert (0 <= INR n) by apply pos_INR.
  unfold gamma_fmt. apply Rmult_le_reg_r with (1 - INR n * u_fmt); [lra|].
  rewrite div_mul_cancel by lra. nra.
Qed.

Lemma gamma_lt_1_of_twice_lt_1 n : 2 * (INR n * u_fmt) < 1 -> gamma_fmt n < 1.
Proof.
  intros Hn. pose proof u_fmt_pos. assert (0 <= INR n) by apply pos_INR.
  unfold gamma_fmt. apply Rmult_lt_reg_r with (1 - INR n * u_fmt); [lra|].
  rewrite div_mul_cancel by lra. lra.
Qed.

Lemma is_fmt_rn choice x : is_fmt (rn_fmt choice x).
Proof.
  unfold is_fmt, rn_fmt. apply generic_format_round.
  - apply FLT_exp_valid. exact prec_gt_0_.
  - apply valid_rnd_N.
Qed.

Lemma is_fmt_0 : is_fmt 0.
Proof. apply generic_format_0. Qed.

Lemma rn_nonneg_of_nonneg choice x : 0 <= x -> 0 <= rn_fmt choice x.
Proof.
  intros Hx. unfold rn_fmt. apply round_ge_generic.
  - apply FLT_exp_valid. exact prec_gt_0_.
  - apply valid_rnd_N.
  - apply generic_format_0.
  - exact Hx.
Qed.

(** One rounded addition of two nonnegative floats loses at most a factor 1 - u, also
    in the subnormal range (where the sum of two floats is exact). *)
Lemma rn_plus_ge_of_nonneg choice x y :
  is_fmt x -> is_fmt y -> 0 <= x -> 0 <= y ->
  (1 - u_fmt) * (x + y) <= rn_fmt choice (x + y).
Proof.
  intros Fx Fy Hx Hy.
  destruct (@FLT_plus_error_N_ex radix2 emin prec prec_gt_0_ choice x y Fx Fy)
    as [eps [Heps Hr]].
  unfold rn_fmt. rewrite Hr.
  rewrite u_ro_eq in Heps.
  pose proof u_fmt_pos.
  assert (Hu : u_fmt / (1 + u_fmt) <= u_fmt).
  { apply Rmult_le_reg_r with (1 + u_fmt); [lra|].
    rewrite div_mul_cancel by lra. nra. }
  assert (He : - u_fmt <= eps) by (apply Rabs_le_inv in Heps; lra).
  nra.
Qed.

Lemma fsum_is_fmt choice n a : is_fmt (fsum_fmt choice n a).
Proof. destruct n; simpl; [apply is_fmt_0|apply is_fmt_rn]. Qed.

(** Main induction: s_n >= (1 - u)^n * (a_0 + ... + a_{n-1}). *)
Lemma pow_one_minus_u_sum_le_fsum choice n a :
  (forall j, (j < n)%nat -> is_fmt (a j) /\ 0 <= a j) ->
  (1 - u_fmt) ^ n * sum n a <= fsum_fmt choice n a.
Proof.
  pose proof u_fmt_pos as Hu0. pose proof u_fmt_lt_1 as Hu1.
  induction n as [|n IH]; intros Ha; simpl; [lra|].
  assert (IH' : (1 - u_fmt) ^ n * sum n a <= fsum_fmt choice n a)
    by (apply IH; intros; apply Ha; lia).
  destruct (Ha n ltac:(lia)) as [Fa Ha0].
  assert (Hsum : 0 <= sum n a)
    by (apply sum_nonneg; intros j Hj; apply Ha; lia).
  assert (Hp0 : 0 <= (1 - u_fmt) ^ n) by (apply pow_le; lra).
  assert (Hp1 : (1 - u_fmt) ^ n <= 1) by (apply pow_le_1_of; lra).
  assert (Hs0 : 0 <= fsum_fmt choice n a) by nra.
  pose proof (rn_plus_ge_of_nonneg choice _ _ (fsum_is_fmt choice n a) Fa Hs0 Ha0).
  assert ((1 - u_fmt) ^ n * a n <= a n) by nra.
  nra.
Qed.

(** The product form, valid whenever n u < 1. *)
Lemma one_minus_gamma_mul_sum_le_fsum choice n a :
  INR n * u_fmt < 1 ->
  (forall j, (j < n)%nat -> is_fmt (a j) /\ 0 <= a j) ->
  (1 - gamma_fmt n) * sum n a <= fsum_fmt choice n a.
Proof.
  intros Hn Ha. pose proof u_fmt_pos. pose proof u_fmt_lt_1.
  assert (Hsum : 0 <= sum n a) by (apply sum_nonneg; intros j Hj; apply Ha; lia).
  pose proof (mul_u_le_gamma_of_lt_1 n Hn).
  pose proof (one_minus_n_mul_le_pow n u_fmt ltac:(lra)).
  pose proof (pow_one_minus_u_sum_le_fsum choice n a Ha).
  nra.
Qed.

(** Division form of the left-to-right sum, for any format (2 n u < 1). *)
Lemma exact_sum_le_computed_div_of_nonneg_fmt choice n a :
  2 * (INR n * u_fmt) < 1 ->
  (forall j, (j < n)%nat -> is_fmt (a j) /\ 0 <= a j) ->
  sum n a <= fsum_fmt choice n a / (1 - gamma_fmt n).
Proof.
  intros Hn Ha. pose proof u_fmt_pos.
  assert (0 <= INR n) by apply pos_INR.
  pose proof (gamma_lt_1_of_twice_lt_1 n Hn).
  pose proof (one_minus_gamma_mul_sum_le_fsum choice n a ltac:(lra) Ha).
  apply Rmult_le_reg_r with (1 - gamma_fmt n); [lra|].
  rewrite div_mul_cancel by lra. lra.
Qed.

(** ** Summation in any order *)

Lemma leaves_nonneg_of_fmt t : leaves_nonneg_fmt t -> leaves_nonneg t.
Proof. induction t as [x|l IHl r IHr]; simpl; tauto. Qed.

Lemma ftree_nonneg_fmt choice t :
  leaves_nonneg_fmt t -> is_fmt (ftree_fmt choice t) /\ 0 <= ftree_fmt choice t.
Proof.
  induction t as [x|l IHl r IHr]; simpl; [tauto|].
  intros [Hl Hr]. destruct (IHl Hl). destruct (IHr Hr). split.
  - apply is_fmt_rn.
  - apply rn_nonneg_of_nonneg. lra.
Qed.

(** Each leaf goes through at most [depth t] rounded additions. *)
Lemma pow_depth_exact_le_ftree choice t :
  leaves_nonneg_fmt t -> (1 - u_fmt) ^ depth t * exact_tree t <= ftree_fmt choice t.
Proof.
  pose proof u_fmt_pos as Hu0. pose proof u_fmt_lt_1 as Hu1.
  induction t as [x|l IHl r IHr]; simpl; [lra|].
  intros [Hl Hr].
  specialize (IHl Hl). specialize (IHr Hr).
  destruct (ftree_nonneg_fmt choice l Hl) as [Fl Pl].
  destruct (ftree_nonneg_fmt choice r Hr) as [Fr Pr].
  pose proof (exact_tree_nonneg_of_nonneg l (leaves_nonneg_of_fmt l Hl)).
  pose proof (exact_tree_nonneg_of_nonneg r (leaves_nonneg_of_fmt r Hr)).
  pose proof (rn_plus_ge_of_nonneg choice _ _ Fl Fr Pl Pr).
  set (d := Nat.max (depth l) (depth r)).
  assert (Hdl : (1 - u_fmt) ^ d <= (1 - u_fmt) ^ depth l)
    by (apply pow_le_pow_of_le; [lra|lia]).
  assert (Hdr : (1 - u_fmt) ^ d <= (1 - u_fmt) ^ depth r)
    by (apply pow_le_pow_of_le; [lra|lia]).
  assert (0 <= (1 - u_fmt) ^ d) by (apply pow_le; lra).
  assert ((1 - u_fmt) ^ d * (exact_tree l + exact_tree r)
          <= ftree_fmt choice l + ftree_fmt choice r) by nra.
  nra.
Qed.

(** Product form for any n bounding the depth (e.g. n = number of terms) with n u < 1. *)
Lemma one_minus_gamma_mul_exact_le_ftree choice t n :
  (depth t <= n)%nat -> INR n * u_fmt < 1 -> leaves_nonneg_fmt t ->
  (1 - gamma_fmt n) * exact_tree t <= ftree_fmt choice t.
Proof.
  intros Hd Hn Ht. pose proof u_fmt_pos. pose proof u_fmt_lt_1.
  pose proof (exact_tree_nonneg_of_nonneg t (leaves_nonneg_of_fmt t Ht)).
  pose proof (mul_u_le_gamma_of_lt_1 n Hn).
  pose proof (one_minus_n_mul_le_pow n u_fmt ltac:(lra)).
  assert ((1 - u_fmt) ^ n <= (1 - u_fmt) ^ depth t)
    by (apply pow_le_pow_of_le; [lra|lia]).
  pose proof (pow_depth_exact_le_ftree choice t Ht).
  nra.
Qed.

(** Division form for trees: a tree reduction of n nonnegative terms with any shape (its
    depth is at most n - 1 < n) is covered by the same margin gamma_n. *)
Lemma exact_tree_le_computed_div_of_nonneg_fmt choice t n :
  (depth t <= n)%nat -> 2 * (INR n * u_fmt) < 1 -> leaves_nonneg_fmt t ->
  exact_tree t <= ftree_fmt choice t / (1 - gamma_fmt n).
Proof.
  intros Hd Hn Ht. pose proof u_fmt_pos.
  assert (0 <= INR n) by apply pos_INR.
  pose proof (gamma_lt_1_of_twice_lt_1 n Hn).
  pose proof (one_minus_gamma_mul_exact_le_ftree choice t n Hd ltac:(lra) Ht).
  apply Rmult_le_reg_r with (1 - gamma_fmt n); [lra|].
  rewrite div_mul_cancel by lra. lra.
Qed.

Lemma exact_tree_le_computed_div_size_of_nonneg_fmt choice t :
  2 * (INR (size t) * u_fmt) < 1 -> leaves_nonneg_fmt t ->
  exact_tree t <= ftree_fmt choice t / (1 - gamma_fmt (size t)).
Proof.
  intros. apply exact_tree_le_computed_div_of_nonneg_fmt; [|assumption|assumption].
  pose proof (depth_lt_size t). lia.
Qed.

(** ** Products and other single roundings *)

(** Any nonnegative real, rounded: relative error u, plus an absolute error of at most
    half the smallest subnormal ([eta_fmt] = 2^(emin-1)) that only occurs below the
    normal range. *)
Lemma rn_ge_sub_of_nonneg choice z :
  0 <= z -> (1 - u_fmt) * z - eta_fmt <= rn_fmt choice z.
Proof.
  intros Hz.
  destruct (error_N_FLT radix2 emin prec prec_gt_0_ choice z)
    as [eps [eta [Heps [Heta [H0 Hr]]]]].
  unfold rn_fmt. rewrite Hr.
  fold (u_ro radix2 prec) in Heps. rewrite u_ro_eq in Heps.
  fold eta_fmt in Heta.
  apply Rabs_le_inv in Heps. apply Rabs_le_inv in Heta.
  pose proof u_fmt_pos.
  destruct (Rmult_integral _ _ H0) as [E|E]; subst; nra.
Qed.

(** Normal range: for z >= 2^(emin + prec - 1) (the least normal number), rounding to
    nearest loses at most a factor 1 - u. This is the case of a product x * y of
    nonnegative floats (e.g. ||q_b|| * rho_b) as long as the product does not underflow;
    below that use [rn_ge_sub_of_nonneg]. *)
Lemma rn_ge_of_normal choice z :
  bpow radix2 (emin + prec - 1) <= z -> (1 - u_fmt) * z <= rn_fmt choice z.
Proof.
  intros Hz.
  pose proof (bpow_gt_0 radix2 (emin + prec - 1)).
  destruct (relative_error_N_FLT_ex radix2 emin prec prec_gt_0_ choice z)
    as [eps [Heps Hr]].
  { rewrite Rabs_pos_eq by lra. exact Hz. }
  unfold rn_fmt. rewrite Hr.
  fold (u_ro radix2 prec) in Heps. rewrite u_ro_eq in Heps.
  apply Rabs_le_inv in Heps. pose proof u_fmt_pos. nra.
Qed.

(** Recursive sum of arbitrary nonnegative reals with one rounding per step: this covers
    fused multiply-add accumulation, acc <- fma(x_k, y_k, acc) = rn(acc + x_k y_k), where
    the terms x_k y_k are exact reals, not floats. Subnormal steps cost [eta_fmt] each. *)
Lemma fsum_nonneg_of_nonneg choice n a :
  (forall j, (j < n)%nat -> 0 <= a j) -> 0 <= fsum_fmt choice n a.
Proof.
  induction n as [|n IH]; intros Ha; simpl; [lra|].
  apply rn_nonneg_of_nonneg.
  assert (0 <= fsum_fmt choice n a) by (apply IH; intros; apply Ha; lia).
  assert (0 <= a n) by (apply Ha; lia). lra.
Qed.

Lemma eta_fmt_pos : 0 < eta_fmt.
Proof. unfold eta_fmt. pose proof (bpow_gt_0 radix2 emin). lra. Qed.

Lemma pow_sum_sub_le_fsum_of_nonneg choice n a :
  (forall j, (j < n)%nat -> 0 <= a j) ->
  (1 - u_fmt) ^ n * sum n a - INR n * eta_fmt <= fsum_fmt choice n a.
Proof.
  pose proof u_fmt_pos as Hu0. pose proof u_fmt_lt_1 as Hu1.
  pose proof eta_fmt_pos as He.
  induction n as [|n IH]; intros Ha; [simpl; lra|].
  rewrite S_INR. simpl sum. simpl fsum_fmt. simpl pow.
  assert (IH' : (1 - u_fmt) ^ n * sum n a - INR n * eta_fmt <= fsum_fmt choice n a)
    by (apply IH; intros; apply Ha; lia).
  assert (Ha0 : 0 <= a n) by (apply Ha; lia).
  assert (Hs0 : 0 <= fsum_fmt choice n a)
    by (apply fsum_nonneg_of_nonneg; intros; apply Ha; lia).
  assert (Hsum : 0 <= sum n a) by (apply sum_nonneg; intros; apply Ha; lia).
  assert (Hp0 : 0 <= (1 - u_fmt) ^ n) by (apply pow_le; lra).
  assert (Hp1 : (1 - u_fmt) ^ n <= 1) by (apply pow_le_1_of; lra).
  assert (0 <= INR n) by apply pos_INR.
  pose proof (rn_ge_sub_of_nonneg choice (fsum_fmt choice n a + a n) ltac:(lra)).
  assert ((1 - u_fmt) ^ n * a n <= a n) by nra.
  assert (0 <= u_fmt * (INR n * eta_fmt)) by (apply Rmult_le_pos; nra).
  assert ((1 - u_fmt) * ((1 - u_fmt) ^ n * sum n a - INR n * eta_fmt)
          <= (1 - u_fmt) * fsum_fmt choice n a) by (apply Rmult_le_compat_l; lra).
  assert ((1 - u_fmt) * ((1 - u_fmt) ^ n * a n) <= (1 - u_fmt) * a n)
    by (apply Rmult_le_compat_l; lra).
  nra.
Qed.

(** Division form for FMA accumulation of n nonnegative exact terms (2 n u < 1). *)
Lemma exact_sum_le_fma_div_of_nonneg choice n a :
  2 * (INR n * u_fmt) < 1 ->
  (forall j, (j < n)%nat -> 0 <= a j) ->
  sum n a <= (fsum_fmt choice n a + INR n * eta_fmt) / (1 - gamma_fmt n).
Proof.
  intros Hn Ha. pose proof u_fmt_pos. pose proof u_fmt_lt_1.
  assert (0 <= INR n) by apply pos_INR.
  assert (Hsum : 0 <= sum n a) by (apply sum_nonneg; exact Ha).
  pose proof (mul_u_le_gamma_of_lt_1 n ltac:(lra)).
  pose proof (gamma_lt_1_of_twice_lt_1 n Hn).
  pose proof (one_minus_n_mul_le_pow n u_fmt ltac:(lra)).
  pose proof (pow_sum_sub_le_fsum_of_nonneg choice n a Ha).
  apply Rmult_le_reg_r with (1 - gamma_fmt n); [lra|].
  rewrite div_mul_cancel by lra. nra.
Qed.

(** Products rounded one by one, then summed: sum of x_j y_j against the sum of the
    rounded products (each rn(x_j y_j) is a nonnegative float, so the main theorem then
    bounds that sum by the computed one). *)
Lemma sum_mul_le_sum_rn_of_nonneg choice n x y :
  (forall j, (j < n)%nat -> 0 <= x j * y j) ->
  (1 - u_fmt) * sum n (fun j => x j * y j) - INR n * eta_fmt
    <= sum n (fun j => rn_fmt choice (x j * y j)).
Proof.
  intros H.
  rewrite <- sum_scal_l.
  replace (INR n * eta_fmt) with (sum n (fun _ => eta_fmt)) by (rewrite sum_const; ring).
  rewrite <- sum_sub. apply sum_le. intros j Hj.
  apply rn_ge_sub_of_nonneg. apply H. exact Hj.
Qed.

(** Trees whose leaves are arbitrary nonnegative reals (exact products fed to a fused
    multiply-add, rounded products, ...): each of the [nodes t] rounded additions may
    also cost [eta_fmt] in the subnormal range. *)
Lemma ftree_nonneg_of_nonneg choice t : leaves_nonneg t -> 0 <= ftree_fmt choice t.
Proof.
  induction t as [x|l IHl r IHr]; simpl; [tauto|].
  intros [Hl Hr]. apply rn_nonneg_of_nonneg.
  specialize (IHl Hl). specialize (IHr Hr). lra.
Qed.

Lemma pow_depth_exact_sub_le_ftree choice t :
  leaves_nonneg t ->
  (1 - u_fmt) ^ depth t * exact_tree t - INR (nodes t) * eta_fmt <= ftree_fmt choice t.
Proof.
  pose proof u_fmt_pos as Hu0. pose proof u_fmt_lt_1 as Hu1.
  pose proof eta_fmt_pos as He.
  induction t as [x|l IHl r IHr]; [simpl; intros; lra|].
  simpl leaves_nonneg. intros [Hl Hr]. cbn [depth nodes exact_tree ftree_fmt pow].
  specialize (IHl Hl). specialize (IHr Hr).
  pose proof (ftree_nonneg_of_nonneg choice l Hl).
  pose proof (ftree_nonneg_of_nonneg choice r Hr).
  pose proof (exact_tree_nonneg_of_nonneg l Hl).
  pose proof (exact_tree_nonneg_of_nonneg r Hr).
  pose proof (rn_ge_sub_of_nonneg choice (ftree_fmt choice l + ftree_fmt choice r)
                ltac:(lra)).
  rewrite S_INR, plus_INR.
  assert (0 <= INR (nodes l)) by apply pos_INR.
  assert (0 <= INR (nodes r)) by apply pos_INR.
  set (d := Nat.max (depth l) (depth r)).
  assert (Hdl : (1 - u_fmt) ^ d <= (1 - u_fmt) ^ depth l)
    by (apply pow_le_pow_of_le; [lra|lia]).
  assert (Hdr : (1 - u_fmt) ^ d <= (1 - u_fmt) ^ depth r)
    by (apply pow_le_pow_of_le; [lra|lia]).
  assert (0 <= (1 - u_fmt) ^ d) by (apply pow_le; lra).
  assert ((1 - u_fmt) ^ d * (exact_tree l + exact_tree r)
          - (INR (nodes l) + INR (nodes r)) * eta_fmt
          <= ftree_fmt choice l + ftree_fmt choice r) by nra.
  assert (0 <= (INR (nodes l) + INR (nodes r)) * eta_fmt) by (apply Rmult_le_pos; lra).
  assert ((1 - u_fmt) * ((INR (nodes l) + INR (nodes r)) * eta_fmt)
          <= (INR (nodes l) + INR (nodes r)) * eta_fmt) by nra.
  assert ((1 - u_fmt) * ((1 - u_fmt) ^ d * (exact_tree l + exact_tree r)
          - (INR (nodes l) + INR (nodes r)) * eta_fmt)
          <= (1 - u_fmt) * (ftree_fmt choice l + ftree_fmt choice r))
    by (apply Rmult_le_compat_l; lra).
  nra.
Qed.

(** Division form for any summation tree of nonnegative reals whose depth is at most n,
    with 2 n u < 1 (for n terms take n itself: depth < size). *)
Lemma exact_tree_le_ftree_sub_div_of_nonneg choice t n :
  (depth t <= n)%nat -> 2 * (INR n * u_fmt) < 1 -> leaves_nonneg t ->
  exact_tree t <= (ftree_fmt choice t + INR (nodes t) * eta_fmt) / (1 - gamma_fmt n).
Proof.
  intros Hd Hn Ht. pose proof u_fmt_pos. pose proof u_fmt_lt_1.
  assert (0 <= INR n) by apply pos_INR.
  pose proof (exact_tree_nonneg_of_nonneg t Ht).
  pose proof (mul_u_le_gamma_of_lt_1 n ltac:(lra)).
  pose proof (gamma_lt_1_of_twice_lt_1 n Hn).
  pose proof (one_minus_n_mul_le_pow n u_fmt ltac:(lra)).
  assert ((1 - u_fmt) ^ n <= (1 - u_fmt) ^ depth t)
    by (apply pow_le_pow_of_le; [lra|lia]).
  pose proof (pow_depth_exact_sub_le_ftree choice t Ht).
  apply Rmult_le_reg_r with (1 - gamma_fmt n); [lra|].
  rewrite div_mul_cancel by lra. nra.
Qed.

End Format.

(** * IEEE binary32: emin = -149, prec = 24 *)

Definition is_f32 (x : R) : Prop := is_fmt (-149) 24 x.

(** Unit roundoff of binary32 and its [gamma_n]. *)
Definition u32 : R := / 2 ^ 24.

Definition gamma32 (n : nat) : R := INR n * u32 / (1 - INR n * u32).

(** Left-to-right binary32 sum and binary32 tree reduction. *)
Definition fsum (choice : Z -> bool) (n : nat) (a : nat -> R) : R :=
  fsum_fmt (-149) 24 choice n a.

Definition ftree (choice : Z -> bool) (t : stree) : R := ftree_fmt (-149) 24 choice t.

Definition leaves_nonneg_f32 (t : stree) : Prop := leaves_nonneg_fmt (-149) 24 t.

Lemma prec32_gt_0 : Prec_gt_0 24.
Proof. unfold Prec_gt_0. lia. Qed.

Lemma u32_eq : u32 = u_fmt 24.
Proof. unfold u32, u_fmt. change (Z.opp 24) with (Zneg 24). rewrite bpow2_neg. reflexivity. Qed.

Lemma gamma32_eq n : gamma32 n = gamma_fmt 24 n.
Proof. unfold gamma32, gamma_fmt. rewrite u32_eq. reflexivity. Qed.

(** What it buys: an fp32 kernel that adds n nonnegative fp32 terms left to right with
    round-to-nearest may report [s_n / (1 - gamma_n)] as a sound upper bound on the exact
    sum, for any n < 2^23 (so that gamma_n < 1), subnormals included. *)
Theorem exact_sum_le_computed_div_of_nonneg choice n a :
  2 * (INR n * u32) < 1 ->
  (forall j, (j < n)%nat -> is_f32 (a j) /\ 0 <= a j) ->
  sum n a <= fsum choice n a / (1 - gamma32 n).
Proof.
  intros Hn Ha. rewrite u32_eq in Hn. rewrite gamma32_eq.
  exact (exact_sum_le_computed_div_of_nonneg_fmt (-149) 24 prec32_gt_0 choice n a Hn Ha).
Qed.

(** What it buys: the same margin for a reduction in ANY tree order (pairwise, blocked,
    a GPU [tl.sum]) of n nonnegative fp32 terms, which is how torch and Triton sum. *)
Theorem exact_tree_le_computed_div_size_of_nonneg choice t :
  2 * (INR (size t) * u32) < 1 -> leaves_nonneg_f32 t ->
  exact_tree t <= ftree choice t / (1 - gamma32 (size t)).
Proof.
  intros Hn Ht. rewrite u32_eq in Hn. rewrite gamma32_eq.
  exact (exact_tree_le_computed_div_size_of_nonneg_fmt (-149) 24 prec32_gt_0 choice t Hn Ht).
Qed.

(** * IEEE binary64: emin = -1074, prec = 53 *)

Definition is_f64 (x : R) : Prop := is_fmt (-1074) 53 x.

Definition u64 : R := / 2 ^ 53.

Definition gamma64 (n : nat) : R := INR n * u64 / (1 - INR n * u64).

Definition fsum64 (choice : Z -> bool) (n : nat) (a : nat -> R) : R :=
  fsum_fmt (-1074) 53 choice n a.

Definition ftree64 (choice : Z -> bool) (t : stree) : R := ftree_fmt (-1074) 53 choice t.

Definition leaves_nonneg_f64 (t : stree) : Prop := leaves_nonneg_fmt (-1074) 53 t.

Lemma prec64_gt_0 : Prec_gt_0 53.
Proof. unfold Prec_gt_0. lia. Qed.

Lemma u64_eq : u64 = u_fmt 53.
Proof. unfold u64, u_fmt. change (Z.opp 53) with (Zneg 53). rewrite bpow2_neg. reflexivity. Qed.

Lemma gamma64_eq n : gamma64 n = gamma_fmt 53 n.
Proof. unfold gamma64, gamma_fmt. rewrite u64_eq. reflexivity. Qed.

(** What it buys: CPU code that adds n nonnegative fp64 terms left to right with
    round-to-nearest may report [s_n / (1 - gamma_n)], u = 2^-53, as a sound upper bound
    on the exact sum, for any n < 2^52, subnormals included. *)
Theorem exact_sum_le_computed_div_of_nonneg_f64 choice n a :
  2 * (INR n * u64) < 1 ->
  (forall j, (j < n)%nat -> is_f64 (a j) /\ 0 <= a j) ->
  sum n a <= fsum64 choice n a / (1 - gamma64 n).
Proof.
  intros Hn Ha. rewrite u64_eq in Hn. rewrite gamma64_eq.
  exact (exact_sum_le_computed_div_of_nonneg_fmt (-1074) 53 prec64_gt_0 choice n a Hn Ha).
Qed.

(** What it buys: the same fp64 margin for a reduction of n nonnegative fp64 terms in ANY
    tree order (pairwise, blocked, vectorized), whatever order a CPU library sums in. *)
Theorem exact_tree_le_computed_div_size_of_nonneg_f64 choice t :
  2 * (INR (size t) * u64) < 1 -> leaves_nonneg_f64 t ->
  exact_tree t <= ftree64 choice t / (1 - gamma64 (size t)).
Proof.
  intros Hn Ht. rewrite u64_eq in Hn. rewrite gamma64_eq.
  exact (exact_tree_le_computed_div_size_of_nonneg_fmt (-1074) 53 prec64_gt_0 choice t Hn Ht).
Qed.

(** * Bridge to bit-level IEEE arithmetic *)

Definition ties_even : Z -> bool := fun k => negb (Z.even k).

(** Flocq's bit-level IEEE format with [prec] bits and largest exponent [emax] (no NaN
    payloads); its least exponent is 3 - emax - prec. Addition rounds ties-to-even. *)
Section Bits.

Variables prec emax : Z.
Hypothesis prec_gt_0_ : Prec_gt_0 prec.
Hypothesis prec_lt_emax_ : BinarySingleNaN.Prec_lt_emax prec emax.

Definition bplus_fmt (x y : BinarySingleNaN.binary_float prec emax)
  : BinarySingleNaN.binary_float prec emax :=
  @BinarySingleNaN.Bplus prec emax prec_gt_0_ prec_lt_emax_ BinarySingleNaN.mode_NE x y.

(** Left-to-right IEEE sum, starting from +0. *)
Fixpoint bsum_fmt (n : nat) (a : nat -> BinarySingleNaN.binary_float prec emax)
  : BinarySingleNaN.binary_float prec emax :=
  match n with
  | O => BinarySingleNaN.B754_zero false
  | S m => bplus_fmt (bsum_fmt m a) (a m)
  end.

Lemma is_fmt_B2R x : is_fmt (3 - emax - prec) prec (@BinarySingleNaN.B2R prec emax x).
Proof. apply BinarySingleNaN.generic_format_B2R. Qed.

Lemma finite_bplus_l x y :
  BinarySingleNaN.is_finite (bplus_fmt x y) = true -> BinarySingleNaN.is_finite x = true.
Proof.
  unfold bplus_fmt.
  destruct x as [sx|sx| |sx mx ex Hx]; destruct y as [sy|sy| |sy my ey Hy];
    simpl; try easy.
  destruct (Bool.eqb sx sy); easy.
Qed.

(** A finite IEEE sum of two finite floats is the rounded real sum. *)
Lemma B2R_bplus_of_finite x y :
  BinarySingleNaN.is_finite x = true -> BinarySingleNaN.is_finite y = true ->
  BinarySingleNaN.is_finite (bplus_fmt x y) = true ->
  BinarySingleNaN.B2R (bplus_fmt x y)
  = rn_fmt (3 - emax - prec) prec ties_even
      (BinarySingleNaN.B2R x + BinarySingleNaN.B2R y).
Proof.
  intros Fx Fy Fs.
  pose proof (@BinarySingleNaN.Bplus_correct prec emax prec_gt_0_ prec_lt_emax_
                BinarySingleNaN.mode_NE x y Fx Fy) as H.
  destruct Rlt_bool.
  - destruct H as [H _]. exact H.
  - destruct H as [H _]. exfalso.
    unfold bplus_fmt in Fs.
    rewrite <- BinarySingleNaN.is_finite_SF_B2SF, H in Fs. discriminate Fs.
Qed.

Lemma B2R_bsum_of_finite n a :
  (forall j, (j < n)%nat -> BinarySingleNaN.is_finite (a j) = true) ->
  BinarySingleNaN.is_finite (bsum_fmt n a) = true ->
  BinarySingleNaN.B2R (bsum_fmt n a)
  = fsum_fmt (3 - emax - prec) prec ties_even n (fun j => BinarySingleNaN.B2R (a j)).
Proof.
  induction n as [|n IH]; intros Ha Fs; simpl; [reflexivity|].
  simpl in Fs.
  pose proof (finite_bplus_l _ _ Fs) as Fm.
  rewrite B2R_bplus_of_finite; [|exact Fm|apply Ha; lia|exact Fs].
  rewrite IH; [reflexivity| |exact Fm].
  intros; apply Ha; lia.
Qed.

(** The main theorem for a bit-level IEEE sum: whenever the computed sum is finite (an
    overflow yields +inf, against which the bound is trivial). *)
Lemma exact_sum_le_bsum_div_of_nonneg_fmt n a :
  2 * (INR n * u_fmt prec) < 1 ->
  (forall j, (j < n)%nat ->
     BinarySingleNaN.is_finite (a j) = true /\ 0 <= BinarySingleNaN.B2R (a j)) ->
  BinarySingleNaN.is_finite (bsum_fmt n a) = true ->
  sum n (fun j => BinarySingleNaN.B2R (a j))
    <= BinarySingleNaN.B2R (bsum_fmt n a) / (1 - gamma_fmt prec n).
Proof.
  intros Hn Ha Fs.
  rewrite B2R_bsum_of_finite; [|intros; apply Ha; assumption|exact Fs].
  apply exact_sum_le_computed_div_of_nonneg_fmt; [exact prec_gt_0_|exact Hn|].
  intros j Hj. split; [apply is_fmt_B2R|apply Ha; exact Hj].
Qed.

End Bits.

(** ** Bit-level binary32 *)

Definition f32 : Type := BinarySingleNaN.binary_float 24 128.

Definition b2r (x : f32) : R := BinarySingleNaN.B2R x.

Definition finite32 (x : f32) : Prop := BinarySingleNaN.is_finite x = true.

Definition bplus32 (x y : f32) : f32 := bplus_fmt 24 128 eq_refl eq_refl x y.

(** Left-to-right binary32 sum, starting from +0. *)
Definition bsum (n : nat) (a : nat -> f32) : f32 := bsum_fmt 24 128 eq_refl eq_refl n a.

Lemma b2r_bsum_of_finite n a :
  (forall j, (j < n)%nat -> finite32 (a j)) -> finite32 (bsum n a) ->
  b2r (bsum n a) = fsum ties_even n (fun j => b2r (a j)).
Proof. apply B2R_bsum_of_finite. Qed.

Lemma exact_sum_le_bsum_div_of_nonneg n a :
  2 * (INR n * u32) < 1 ->
  (forall j, (j < n)%nat -> finite32 (a j) /\ 0 <= b2r (a j)) ->
  finite32 (bsum n a) ->
  sum n (fun j => b2r (a j)) <= b2r (bsum n a) / (1 - gamma32 n).
Proof.
  intros Hn Ha Fs. rewrite u32_eq in Hn. rewrite gamma32_eq.
  exact (exact_sum_le_bsum_div_of_nonneg_fmt 24 128 eq_refl eq_refl n a Hn Ha Fs).
Qed.

(** ** Bit-level binary64 *)

Definition f64 : Type := BinarySingleNaN.binary_float 53 1024.

Definition b2r64 (x : f64) : R := BinarySingleNaN.B2R x.

Definition finite64 (x : f64) : Prop := BinarySingleNaN.is_finite x = true.

(** Left-to-right binary64 sum, starting from +0. *)
Definition bsum64 (n : nat) (a : nat -> f64) : f64 := bsum_fmt 53 1024 eq_refl eq_refl n a.

Lemma b2r_bsum64_of_finite n a :
  (forall j, (j < n)%nat -> finite64 (a j)) -> finite64 (bsum64 n a) ->
  b2r64 (bsum64 n a) = fsum64 ties_even n (fun j => b2r64 (a j)).
Proof. apply B2R_bsum_of_finite. Qed.

Lemma exact_sum_le_bsum64_div_of_nonneg n a :
  2 * (INR n * u64) < 1 ->
  (forall j, (j < n)%nat -> finite64 (a j) /\ 0 <= b2r64 (a j)) ->
  finite64 (bsum64 n a) ->
  sum n (fun j => b2r64 (a j)) <= b2r64 (bsum64 n a) / (1 - gamma64 n).
Proof.
  intros Hn Ha Fs. rewrite u64_eq in Hn. rewrite gamma64_eq.
  exact (exact_sum_le_bsum_div_of_nonneg_fmt 53 1024 eq_refl eq_refl n a Hn Ha Fs).
Qed.
