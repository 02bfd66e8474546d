(** T8d-T8f: the signed floating-point dot product behind the logit rounding term [e]
    (fast.core.certify.logit_rounding), the product with the scale, and the
    lower-direction bound on computed sums of nonnegative terms (the lower bounds on Z, M
    and B' of fast.core.certify.forms_from_pmz). Same format model as Float.v: Flocq's
    FLT_exp emin prec, round to nearest with any tie rule, gradual underflow, no overflow. *)
From Coq Require Import Reals Lra Lia.
From Flocq Require Import Core Plus_error Relative.
From KVCert Require Import Prelim Float.
Open Scope R_scope.

(** * Dot-product evaluation trees

    Every way of computing sum_i q_i k_i in floating point with products, additions and
    fused multiply-adds, in any order and any blocking: [DLeaf i] is the rounded product
    rn(q_i k_i), [DAdd l r] a rounded addition, [DFma i t] a fused multiply-add
    rn(q_i k_i + t). The index multiset of the leaves is the set of terms summed. *)
Inductive dtree : Type :=
  | DLeaf (i : nat)
  | DAdd (l r : dtree)
  | DFma (i : nat) (t : dtree).

Fixpoint dexact (q k : nat -> R) (t : dtree) : R :=
  match t with
  | DLeaf i => q i * k i
  | DAdd l r => dexact q k l + dexact q k r
  | DFma i t => q i * k i + dexact q k t
  end.

(** sum_i |q_i k_i| over the terms of the tree. *)
Fixpoint dabs (q k : nat -> R) (t : dtree) : R :=
  match t with
  | DLeaf i => Rabs (q i * k i)
  | DAdd l r => dabs q k l + dabs q k r
  | DFma i t => Rabs (q i * k i) + dabs q k t
  end.

(** Number of terms (leaves and fused products). *)
Fixpoint dterms (t : dtree) : nat :=
  match t with
  | DLeaf _ => 1
  | DAdd l r => dterms l + dterms r
  | DFma _ t => S (dterms t)
  end.

(** Roundings on the longest path, and roundings in all. *)
Fixpoint ddepth (t : dtree) : nat :=
  match t with
  | DLeaf _ => 1
  | DAdd l r => S (Nat.max (ddepth l) (ddepth r))
  | DFma _ t => S (ddepth t)
  end.

Fixpoint dops (t : dtree) : nat :=
  match t with
  | DLeaf _ => 1
  | DAdd l r => S (dops l + dops r)
  | DFma _ t => S (dops t)
  end.

Lemma ddepth_le_dterms t : (ddepth t <= dterms t)%nat.
Proof.
  induction t as [i|l IHl r IHr|i t IH]; simpl; [lia| |lia].
  assert (1 <= ddepth l)%nat by (destruct l; simpl; lia).
  assert (1 <= ddepth r)%nat by (destruct r; simpl; lia). lia.
Qed.

Lemma dops_lt_twice_dterms t : (dops t + 1 <= 2 * dterms t)%nat.
Proof. induction t as [i|l IHl r IHr|i t IH]; simpl; lia. Qed.

Lemma dabs_nonneg q k t : 0 <= dabs q k t.
Proof.
  induction t as [i|l IHl r IHr|i t IH]; simpl;
    [apply Rabs_pos|lra|pose proof (Rabs_pos (q i * k i)); lra].
Qed.

Lemma abs_dexact_le_dabs q k t : Rabs (dexact q k t) <= dabs q k t.
Proof.
  induction t as [i|l IHl r IHr|i t IH]; simpl; [lra| |];
    (eapply Rle_trans; [apply Rabs_triang|lra]).
Qed.

Lemma one_add_pow_ge_1 u n : 0 <= u -> 1 <= (1 + u) ^ n.
Proof. intros Hu. apply pow_R1_Rle. lra. Qed.

(** (1 + u)^n <= 1/(1 - n u): the classical gamma_n bound (Higham, Lemma 3.1). *)
Lemma one_add_pow_le_inv u n :
  0 <= u -> INR n * u < 1 -> (1 + u) ^ n <= / (1 - INR n * u).
Proof.
  intros Hu Hn. assert (Hu1 : u < 1 \/ u >= 1) by lra.
  destruct n as [|n]; [simpl; rewrite Rmult_0_l, Rminus_0_r, Rinv_1; lra|].
  assert (Hu' : u < 1).
  { rewrite S_INR in Hn. assert (0 <= INR n) by apply pos_INR. nra. }
  assert (HB := one_minus_n_mul_le_pow (S n) u ltac:(lra)).
  assert (Hp : 0 < (1 - u) ^ S n) by (apply pow_lt; lra).
  assert (Hq : (1 + u) ^ S n * (1 - u) ^ S n <= 1).
  { rewrite <- Rpow_mult_distr. apply pow_le_1_of. nra. }
  apply Rmult_le_reg_r with (1 - INR (S n) * u); [lra|].
  rewrite Rinv_l by lra.
  assert (0 <= (1 + u) ^ S n) by (apply pow_le; lra). nra.
Qed.

Section Format.

Variables emin prec : Z.
Hypothesis prec_gt_0_ : Prec_gt_0 prec.

Notation rn := (rn_fmt emin prec).
Notation u := (u_fmt prec).
Notation eta := (eta_fmt emin).

Fixpoint dcomp (choice : Z -> bool) (q k : nat -> R) (t : dtree) : R :=
  match t with
  | DLeaf i => rn choice (q i * k i)
  | DAdd l r => rn choice (dcomp choice q k l + dcomp choice q k r)
  | DFma i t => rn choice (q i * k i + dcomp choice q k t)
  end.

(** One rounding to nearest of any real: relative u and, below the normal range, absolute
    half the smallest subnormal. *)
Lemma abs_rn_sub_le choice z : Rabs (rn choice z - z) <= u * Rabs z + eta.
Proof.
  destruct (error_N_FLT radix2 emin prec prec_gt_0_ choice z)
    as [eps [et [Heps [Het [_ Hr]]]]].
  unfold rn_fmt. rewrite Hr.
  fold (u_ro radix2 prec) in Heps. rewrite (u_ro_eq prec) in Heps.
  fold (eta_fmt emin) in Het.
  replace (z * (1 + eps) + et - z) with (z * eps + et) by ring.
  eapply Rle_trans; [apply Rabs_triang|]. rewrite Rabs_mult.
  assert (0 <= Rabs z) by apply Rabs_pos.
  assert (Rabs z * Rabs eps <= Rabs z * u) by (apply Rmult_le_compat_l; lra). lra.
Qed.

(** Main induction: the error of the tree is at most ((1 + u)^depth - 1) sum |q_i k_i|
    plus one subnormal term per rounding, amplified by (1 + u)^depth. *)
Lemma abs_dcomp_sub_le_pow choice q k t :
  Rabs (dcomp choice q k t - dexact q k t)
  <= ((1 + u) ^ ddepth t - 1) * dabs q k t + INR (dops t) * eta * (1 + u) ^ ddepth t.
Proof.
  pose proof (u_fmt_pos prec) as Hu. pose proof (eta_fmt_pos emin) as He.
  induction t as [i|l IHl r IHr|i t IH]; simpl dcomp; simpl dexact; simpl dabs.
  - simpl ddepth. simpl dops. pose proof (abs_rn_sub_le choice (q i * k i)). simpl.
    assert (0 <= u * eta) by nra. assert (0 <= Rabs (q i * k i)) by apply Rabs_pos. nra.
  - set (vl := dcomp choice q k l) in *. set (vr := dcomp choice q k r) in *.
    set (xl := dexact q k l) in *. set (xr := dexact q k r) in *.
    assert (Hal := abs_dexact_le_dabs q k l). assert (Har := abs_dexact_le_dabs q k r).
    fold xl in Hal. fold xr in Har.
    set (al := dabs q k l) in *. set (ar := dabs q k r) in *.
    set (P := (1 + u) ^ Nat.max (ddepth l) (ddepth r)).
    assert (HP1 : 1 <= P) by (apply one_add_pow_ge_1; lra).
    assert (HPl : (1 + u) ^ ddepth l <= P) by (apply Rle_pow; [lra|lia]).
    assert (HPr : (1 + u) ^ ddepth r <= P) by (apply Rle_pow; [lra|lia]).
    assert (Hml := pos_INR (dops l)). assert (Hmr := pos_INR (dops r)).
    assert (0 <= al) by (unfold al; apply dabs_nonneg).
    assert (0 <= ar) by (unfold ar; apply dabs_nonneg).
    assert (El : Rabs (vl - xl) <= (P - 1) * al + INR (dops l) * eta * P).
    { eapply Rle_trans; [exact IHl|]. assert (0 <= INR (dops l) * eta) by nra. nra. }
    assert (Er : Rabs (vr - xr) <= (P - 1) * ar + INR (dops r) * eta * P).
    { eapply Rle_trans; [exact IHr|]. assert (0 <= INR (dops r) * eta) by nra. nra. }
    pose proof (abs_rn_sub_le choice (vl + vr)) as Hrn.
    assert (Hv : Rabs (vl + vr) <= al + ar + Rabs (vl - xl) + Rabs (vr - xr)).
    { replace (vl + vr) with (xl + xr + ((vl - xl) + (vr - xr))) by ring.
      eapply Rle_trans; [apply Rabs_triang|].
      pose proof (Rabs_triang xl xr). pose proof (Rabs_triang (vl - xl) (vr - xr)). lra. }
    replace (rn choice (vl + vr) - (xl + xr))
      with ((rn choice (vl + vr) - (vl + vr)) + ((vl - xl) + (vr - xr))) by ring.
    eapply Rle_trans; [apply Rabs_triang|].
    pose proof (Rabs_triang (vl - xl) (vr - xr)).
    simpl ddepth. simpl dops. rewrite S_INR, plus_INR. simpl pow. fold P.
    assert (0 <= Rabs (vl - xl)) by apply Rabs_pos. assert (0 <= Rabs (vr - xr)) by apply Rabs_pos.
    assert (Hm : 0 <= (INR (dops l) + INR (dops r)) * eta) by nra.
    assert (G1 : u * Rabs (vl + vr) <= u * (al + ar + Rabs (vl - xl) + Rabs (vr - xr)))
      by (apply Rmult_le_compat_l; lra).
    assert (G2 : (1 + u) * (Rabs (vl - xl) + Rabs (vr - xr))
                 <= (1 + u) * ((P - 1) * (al + ar) + (INR (dops l) + INR (dops r)) * eta * P))
      by (apply Rmult_le_compat_l; lra).
    assert (G3 : eta <= (1 + u) * P * eta).
    { assert (1 <= (1 + u) * P) by nra.
      assert (0 <= ((1 + u) * P - 1) * eta) by (apply Rmult_le_pos; lra). lra. }
    lra.
  - set (vt := dcomp choice q k t) in *. set (xt := dexact q k t) in *.
    assert (Hat := abs_dexact_le_dabs q k t). fold xt in Hat.
    set (at_ := dabs q k t) in *. set (z := q i * k i) in *.
    set (P := (1 + u) ^ ddepth t) in *.
    assert (HP1 : 1 <= P) by (apply one_add_pow_ge_1; lra).
    assert (Hm := pos_INR (dops t)).
    assert (0 <= at_) by (unfold at_; apply dabs_nonneg).
    assert (Hz : 0 <= Rabs z) by apply Rabs_pos.
    pose proof (abs_rn_sub_le choice (z + vt)) as Hrn.
    assert (Hv : Rabs (z + vt) <= Rabs z + at_ + Rabs (vt - xt)).
    { replace (z + vt) with (z + (xt + (vt - xt))) by ring.
      eapply Rle_trans; [apply Rabs_triang|].
      pose proof (Rabs_triang xt (vt - xt)). lra. }
    replace (rn choice (z + vt) - (z + xt))
      with ((rn choice (z + vt) - (z + vt)) + (vt - xt)) by ring.
    eapply Rle_trans; [apply Rabs_triang|].
    simpl ddepth. simpl dops. rewrite S_INR. simpl pow. fold P.
    assert (0 <= Rabs (vt - xt)) by apply Rabs_pos.
    assert (0 <= INR (dops t) * eta) by nra.
    assert (G1 : u * Rabs (z + vt) <= u * (Rabs z + at_ + Rabs (vt - xt)))
      by (apply Rmult_le_compat_l; lra).
    assert (G2 : (1 + u) * Rabs (vt - xt) <= (1 + u) * ((P - 1) * at_ + INR (dops t) * eta * P))
      by (apply Rmult_le_compat_l; lra).
    assert (G3 : eta <= (1 + u) * P * eta).
    { assert (1 <= (1 + u) * P) by nra.
      assert (0 <= ((1 + u) * P - 1) * eta) by (apply Rmult_le_pos; lra). lra. }
    assert (G4 : u * Rabs z <= ((1 + u) * P - 1) * Rabs z).
    { apply Rmult_le_compat_r; [lra|]. nra. }
    lra.
Qed.

(** The dot product in any order, with or without FMA, over n terms (n u < 1):
    |fl(sum q_i k_i) - sum q_i k_i| <= gamma_n sum |q_i k_i| + (2n - 1) eta / (1 - n u). *)
Lemma abs_dcomp_sub_le_gamma choice q k t :
  INR (dterms t) * u < 1 ->
  Rabs (dcomp choice q k t - dexact q k t)
  <= gamma_fmt prec (dterms t) * dabs q k t
     + (2 * INR (dterms t) - 1) * eta / (1 - INR (dterms t) * u).
Proof.
  intros Hn. pose proof (u_fmt_pos prec) as Hu. pose proof (eta_fmt_pos emin) as He.
  set (n := dterms t) in *.
  assert (Hd := ddepth_le_dterms t). assert (Ho := dops_lt_twice_dterms t). fold n in Hd, Ho.
  assert (Hdn : INR (ddepth t) * u < 1).
  { apply Rle_lt_trans with (INR n * u); [|exact Hn].
    apply Rmult_le_compat_r; [lra|]. apply le_INR. exact Hd. }
  assert (HP := one_add_pow_le_inv u (ddepth t) ltac:(lra) Hdn).
  assert (HPn : / (1 - INR (ddepth t) * u) <= / (1 - INR n * u)).
  { apply Rinv_le_contravar; [lra|].
    assert (INR (ddepth t) <= INR n) by (apply le_INR; exact Hd). nra. }
  assert (HP1 := one_add_pow_ge_1 u (ddepth t) ltac:(lra)).
  assert (Hops : INR (dops t) <= 2 * INR n - 1).
  { assert (INR (dops t + 1) <= INR (2 * n)) by (apply le_INR; exact Ho).
    rewrite plus_INR, mult_INR in H. simpl in H. lra. }
  assert (Hg : / (1 - INR n * u) - 1 = gamma_fmt prec n) by (unfold gamma_fmt; field; lra).
  assert (Ha := dabs_nonneg q k t).
  eapply Rle_trans; [apply abs_dcomp_sub_le_pow|].
  apply Rplus_le_compat.
  - apply Rmult_le_compat_r; [exact Ha|]. lra.
  - assert (Hpos : 0 <= INR (dops t)) by apply pos_INR.
    assert (Hi : 0 < / (1 - INR n * u)) by (apply Rinv_0_lt_compat; lra).
    assert (HPe : (1 + u) ^ ddepth t <= / (1 - INR n * u)) by lra.
    unfold Rdiv.
    apply Rle_trans with (INR (dops t) * (eta * / (1 - INR n * u))).
    + rewrite Rmult_assoc. apply Rmult_le_compat_l; [exact Hpos|].
      apply Rmult_le_compat_l; lra.
    + replace ((2 * INR n - 1) * eta * / (1 - INR n * u))
        with ((2 * INR n - 1) * (eta * / (1 - INR n * u))) by ring.
      apply Rmult_le_compat_r; [|exact Hops]. apply Rmult_le_pos; lra.
Qed.

(** The product of a computed dot product by the fp32 scale s32 = fl(s) (|s32 - s| <= u s):
    one more rounding. *)
Lemma abs_rn_scaled_sub_le choice dh d s s32 E S :
  0 <= s -> Rabs (s32 - s) <= u * s -> Rabs (dh - d) <= E -> Rabs d <= S ->
  Rabs (rn choice (dh * s32) - s * d)
  <= (1 + u) ^ 2 * s * E + (2 * u + u ^ 2) * s * S + eta.
Proof.
  intros Hs Hs32 HE HS. pose proof (u_fmt_pos prec) as Hu.
  pose proof (abs_rn_sub_le choice (dh * s32)) as Hrn.
  assert (HE0 : 0 <= E) by (eapply Rle_trans; [apply Rabs_pos|exact HE]).
  assert (HS0 : 0 <= S) by (eapply Rle_trans; [apply Rabs_pos|exact HS]).
  assert (Hs32a : Rabs s32 <= (1 + u) * s).
  { replace s32 with (s + (s32 - s)) by ring. eapply Rle_trans; [apply Rabs_triang|].
    rewrite Rabs_pos_eq by lra. lra. }
  assert (Hy : Rabs (dh * s32 - s * d) <= (1 + u) * s * E + u * s * S).
  { replace (dh * s32 - s * d) with (s32 * (dh - d) + d * (s32 - s)) by ring.
    eapply Rle_trans; [apply Rabs_triang|]. rewrite !Rabs_mult.
    assert (0 <= Rabs s32) by apply Rabs_pos. assert (0 <= Rabs d) by apply Rabs_pos.
    assert (0 <= Rabs (dh - d)) by apply Rabs_pos. assert (0 <= Rabs (s32 - s)) by apply Rabs_pos.
    apply Rplus_le_compat; [|nra].
    apply Rle_trans with ((1 + u) * s * Rabs (dh - d)); [nra|].
    apply Rmult_le_compat_l; nra. }
  assert (Hya : Rabs (dh * s32) <= s * S + ((1 + u) * s * E + u * s * S)).
  { replace (dh * s32) with (s * d + (dh * s32 - s * d)) by ring.
    eapply Rle_trans; [apply Rabs_triang|]. rewrite Rabs_mult, (Rabs_pos_eq s) by lra.
    assert (s * Rabs d <= s * S) by (apply Rmult_le_compat_l; lra). lra. }
  replace (rn choice (dh * s32) - s * d)
    with ((rn choice (dh * s32) - dh * s32) + (dh * s32 - s * d)) by ring.
  eapply Rle_trans; [apply Rabs_triang|].
  assert (0 <= s * E) by nra. assert (0 <= s * S) by nra.
  nra.
Qed.

(** A scale that is a normal number rounds with relative error u. *)
Lemma abs_rn_sub_le_of_normal choice s :
  bpow radix2 (emin + prec - 1) <= s -> Rabs (rn choice s - s) <= u * s.
Proof.
  intros Hs. pose proof (bpow_gt_0 radix2 (emin + prec - 1)).
  destruct (relative_error_N_FLT_ex radix2 emin prec prec_gt_0_ choice s) as [eps [Heps Hr]].
  { rewrite Rabs_pos_eq by lra. exact Hs. }
  unfold rn_fmt. rewrite Hr.
  fold (u_ro radix2 prec) in Heps. rewrite (u_ro_eq prec) in Heps.
  replace (s * (1 + eps) - s) with (s * eps) by ring.
  rewrite Rabs_mult, (Rabs_pos_eq s) by lra. rewrite (Rmult_comm u). apply Rmult_le_compat_l; lra.
Qed.

(** ** Lower direction: a computed sum of nonnegative floats is at most (1 + u)^depth times
    the exact sum (each rounded addition of two nonnegative floats is at most (1 + u) times
    exact, subnormals included). *)
Lemma rn_plus_le_of_nonneg choice x y :
  is_fmt emin prec x -> is_fmt emin prec y -> 0 <= x -> 0 <= y ->
  rn choice (x + y) <= (1 + u) * (x + y).
Proof.
  intros Fx Fy Hx Hy.
  destruct (@FLT_plus_error_N_ex radix2 emin prec prec_gt_0_ choice x y Fx Fy)
    as [eps [Heps Hr]].
  unfold rn_fmt. rewrite Hr. rewrite (u_ro_eq prec) in Heps.
  pose proof (u_fmt_pos prec).
  assert (Hu : u / (1 + u) <= u).
  { apply Rmult_le_reg_r with (1 + u); [lra|]. rewrite div_mul_cancel by lra. nra. }
  assert (He : eps <= u) by (apply Rabs_le_inv in Heps; lra).
  nra.
Qed.

Lemma ftree_le_pow_depth_exact choice t :
  leaves_nonneg_fmt emin prec t ->
  ftree_fmt emin prec choice t <= (1 + u) ^ depth t * exact_tree t.
Proof.
  pose proof (u_fmt_pos prec) as Hu0.
  induction t as [x|l IHl r IHr]; simpl; [lra|].
  intros [Hl Hr].
  specialize (IHl Hl). specialize (IHr Hr).
  destruct (ftree_nonneg_fmt emin prec prec_gt_0_ choice l Hl) as [Fl Pl].
  destruct (ftree_nonneg_fmt emin prec prec_gt_0_ choice r Hr) as [Fr Pr].
  pose proof (exact_tree_nonneg_of_nonneg l (leaves_nonneg_of_fmt emin prec l Hl)).
  pose proof (exact_tree_nonneg_of_nonneg r (leaves_nonneg_of_fmt emin prec r Hr)).
  pose proof (rn_plus_le_of_nonneg choice _ _ Fl Fr Pl Pr).
  set (d := Nat.max (depth l) (depth r)).
  assert (Hdl : (1 + u) ^ depth l <= (1 + u) ^ d) by (apply Rle_pow; [lra|lia]).
  assert (Hdr : (1 + u) ^ depth r <= (1 + u) ^ d) by (apply Rle_pow; [lra|lia]).
  assert (ftree_fmt emin prec choice l + ftree_fmt emin prec choice r
          <= (1 + u) ^ d * (exact_tree l + exact_tree r)) by nra.
  nra.
Qed.

(** Division-free form: computed * (1 - gamma_n) <= exact for a tree of n terms (n u < 1). *)
Lemma computed_mul_one_sub_gamma_le_exact_fmt choice t :
  INR (size t) * u < 1 -> leaves_nonneg_fmt emin prec t ->
  ftree_fmt emin prec choice t * (1 - gamma_fmt prec (size t)) <= exact_tree t.
Proof.
  intros Hn Ht. pose proof (u_fmt_pos prec) as Hu.
  assert (Hd := depth_lt_size t).
  assert (Hdn : INR (depth t) * u < 1).
  { apply Rle_lt_trans with (INR (size t) * u); [|exact Hn].
    apply Rmult_le_compat_r; [lra|]. apply le_INR. lia. }
  assert (HP := one_add_pow_le_inv u (depth t) ltac:(lra) Hdn).
  assert (HF := ftree_le_pow_depth_exact choice t Ht).
  destruct (ftree_nonneg_fmt emin prec prec_gt_0_ choice t Ht) as [_ Hc].
  assert (He := exact_tree_nonneg_of_nonneg t (leaves_nonneg_of_fmt emin prec t Ht)).
  assert (Hg : 1 - gamma_fmt prec (size t) <= 1 - INR (depth t) * u).
  { unfold gamma_fmt. assert (INR (depth t) <= INR (size t)) by (apply le_INR; lia).
    assert (0 <= INR (depth t)) by apply pos_INR.
    assert (INR (size t) * u <= INR (size t) * u / (1 - INR (size t) * u)).
    { apply Rmult_le_reg_r with (1 - INR (size t) * u); [lra|].
      rewrite div_mul_cancel by lra. assert (0 <= INR (size t) * u) by nra. nra. }
    nra. }
  assert (Hinv : (1 + u) ^ depth t * (1 - INR (depth t) * u) <= 1).
  { apply Rmult_le_reg_r with (/ (1 - INR (depth t) * u)).
    - apply Rinv_0_lt_compat. lra.
    - rewrite Rmult_assoc, Rinv_r by lra. lra. }
  assert (0 <= 1 - INR (depth t) * u) by lra.
  destruct (Rle_lt_dec 0 (1 - gamma_fmt prec (size t))) as [Hg0|Hg0]; [|nra].
  apply Rle_trans with (ftree_fmt emin prec choice t * (1 - INR (depth t) * u));
    [apply Rmult_le_compat_l; lra|].
  apply Rle_trans with ((1 + u) ^ depth t * exact_tree t * (1 - INR (depth t) * u));
    [apply Rmult_le_compat_r; lra|].
  replace ((1 + u) ^ depth t * exact_tree t * (1 - INR (depth t) * u))
    with (((1 + u) ^ depth t * (1 - INR (depth t) * u)) * exact_tree t) by ring.
  nra.
Qed.

End Format.

(** * Instances and the code's constant *)

(** The constants of the code's e: with P <= 1 + 7u the amplification of the dot product's
    error and Q <= 2 + 3u the count of later roundings, everything fits in (D + 4) u 1.01. *)
Lemma code_factor_gen u n P Q :
  0 < u -> u <= / 1000000 -> 0 <= n -> 200 * (n * u) <= 1 -> 1 <= P <= 1 + 7 * u ->
  0 <= Q <= 2 + 3 * u ->
  P * (n * u / (1 - n * u)) + Q * (2 * u + u ^ 2) <= (n + 4) * u * (101 / 100)
  /\ P * (2 * n - 1) / (1 - n * u) <= (202 / 100) * n.
Proof.
  intros Hu Hu1 Hn Hw HP HQ.
  set (w := n * u) in *.
  assert (Hw0 : 0 <= w) by (unfold w; nra).
  assert (H1w : 199 / 200 <= 1 - w) by lra.
  set (g := w / (1 - w)).
  assert (Hg : g * (1 - w) = w) by (unfold g; field; lra).
  assert (Hg0 : 0 <= g) by (unfold g; apply Rmult_le_pos; [lra|left; apply Rinv_0_lt_compat; lra]).
  assert (Hgw : g <= w * (200 / 199)) by nra.
  split.
  - assert (Hp : P * g <= (1 + 7 * u) * (w * (200 / 199))) by (apply Rmult_le_compat; nra).
    assert (Hp2 : (1 + 7 * u) * (w * (200 / 199)) <= w * (101 / 100)) by nra.
    assert (Hq : Q * (2 * u + u ^ 2) <= (2 + 3 * u) * (2 * u + u ^ 2))
      by (apply Rmult_le_compat_r; nra).
    assert (Hq2 : (2 + 3 * u) * (2 * u + u ^ 2) <= (404 / 100) * u) by nra.
    assert (Hr : (n + 4) * u * (101 / 100) = w * (101 / 100) + (404 / 100) * u) by (unfold w; field).
    rewrite Hr. lra.
  - unfold Rdiv. set (i := / (1 - w)).
    assert (Hi : i * (1 - w) = 1) by (unfold i; field; lra).
    assert (Hi0 : 0 < i) by (unfold i; apply Rinv_0_lt_compat; lra).
    assert (Hi1 : i <= 200 / 199) by nra.
    destruct (Rle_lt_dec 1 (2 * n)) as [H2n|H2n].
    + assert (Hq : P * (2 * n - 1) <= (1 + 7 * u) * (2 * n)) by nra.
      assert (Hq2 : P * (2 * n - 1) * i <= (1 + 7 * u) * (2 * n) * (200 / 199))
        by (apply Rmult_le_compat; nra).
      nra.
    + assert (P * (2 * n - 1) * i <= 0).
      { assert (0 <= P * (1 - 2 * n)) by nra. nra. }
      lra.
Qed.

Lemma code_factor_le u n :
  0 < u -> u <= / 1000000 -> 0 <= n -> 200 * (n * u) <= 1 ->
  (1 + u) ^ 2 * (n * u / (1 - n * u)) + 2 * u + u ^ 2 <= (n + 4) * u * (101 / 100)
  /\ (1 + u) ^ 2 * (2 * n - 1) / (1 - n * u) <= (202 / 100) * n.
Proof.
  intros Hu Hu1 Hn Hw.
  destruct (code_factor_gen u n ((1 + u) ^ 2) 1 Hu Hu1 Hn Hw) as [H1 H2]; [split; nra|lra|].
  split; [lra|exact H2].
Qed.

(** Rounding to nearest in binary32 (the GPU and CPU kernels' logits). *)
Definition rn32 (choice : Z -> bool) (x : R) : R := rn_fmt (-149) 24 choice x.

Definition dcomp32 (choice : Z -> bool) (q k : nat -> R) (t : dtree) : R :=
  dcomp (-149) 24 choice q k t.

(** Half the smallest binary32 subnormal. *)
Definition eta32 : R := / 2 ^ 150.

Lemma eta32_eq : eta32 = eta_fmt (-149).
Proof.
  unfold eta32, eta_fmt. change (-149)%Z with (Zneg 149). rewrite bpow2_neg.
  change (Pos.to_nat 149) with 149%nat.
  change 150%nat with (1 + 149)%nat. rewrite pow_add, pow_1.
  rewrite Rinv_mult. reflexivity.
Qed.

Lemma u32_small : 0 < u32 /\ u32 <= / 1000000.
Proof.
  split; [rewrite u32_eq; apply u_fmt_pos|].
  unfold u32. apply Rinv_le_contravar; [lra|]. simpl. lra.
Qed.

(** T8d: the signed binary32 dot product of n terms, in any order, blocked or pairwise,
    with or without fused multiply-add, subnormals included:
    |fl(sum q_i k_i) - sum q_i k_i| <= gamma_n sum |q_i k_i| + (2n - 1) 2^-150 / (1 - n u). *)
Theorem abs_fdot_sub_le_f32 choice q k t :
  INR (dterms t) * u32 < 1 ->
  Rabs (dcomp32 choice q k t - dexact q k t)
  <= gamma32 (dterms t) * dabs q k t
     + (2 * INR (dterms t) - 1) * eta32 / (1 - INR (dterms t) * u32).
Proof.
  intros Hn. rewrite eta32_eq, gamma32_eq. rewrite u32_eq in *.
  exact (abs_dcomp_sub_le_gamma (-149) 24 prec32_gt_0 choice q k t Hn).
Qed.

(** T8e: the fp32 logit x^ = fl(fl(q . k~) * s32) of fast.core.attention, s32 = fl32(s):
    for D = n terms with 200 D u <= 1 (D <= 83886),
    |x^ - s <q, k~>| <= (D + 4) u 1.01 s sum |q_i k~_i| + (2.02 D s + 1) 2^-150.
    The code's e (fast.core.certify.logit_rounding) is the whole right-hand side: the relative
    part as (D + 4) u32 1.01 s sum |q_i| kmax_i, the absolute part (products below the normal
    range) as (2.03 D s + 1) 2^-150. *)
Theorem logit_rounding_le_code_f32 choice q k t s s32 :
  200 * (INR (dterms t) * u32) <= 1 -> 0 <= s -> Rabs (s32 - s) <= u32 * s ->
  Rabs (rn32 choice (dcomp32 choice q k t * s32) - s * dexact q k t)
  <= (INR (dterms t) + 4) * u32 * (101 / 100) * s * dabs q k t
     + ((202 / 100) * INR (dterms t) * s + 1) * eta32.
Proof.
  intros Hn Hs Hs32.
  destruct u32_small as [Hu Hu1].
  assert (Hn0 := pos_INR (dterms t)).
  destruct (code_factor_le u32 (INR (dterms t)) Hu Hu1 Hn0 Hn) as [Hrel Habs].
  assert (Hd := abs_fdot_sub_le_f32 choice q k t ltac:(lra)).
  assert (Ha := dabs_nonneg q k t). assert (HS := abs_dexact_le_dabs q k t).
  rewrite u32_eq in Hs32.
  assert (Hsc := abs_rn_scaled_sub_le (-149) 24 prec32_gt_0 choice
                   (dcomp32 choice q k t) (dexact q k t) s s32 _ _ Hs Hs32 Hd HS).
  rewrite <- u32_eq, <- eta32_eq in Hsc. fold (rn32 choice (dcomp32 choice q k t * s32)) in Hsc.
  eapply Rle_trans; [exact Hsc|].
  unfold gamma32 in *.
  set (n := INR (dterms t)) in *. set (a := dabs q k t) in *.
  assert (He : 0 < eta32) by (unfold eta32; apply Rinv_0_lt_compat; apply pow_lt; lra).
  assert (H1 : (1 + u32) ^ 2 * s * (n * u32 / (1 - n * u32) * a) + (2 * u32 + u32 ^ 2) * s * a
               <= (n + 4) * u32 * (101 / 100) * s * a).
  { replace ((1 + u32) ^ 2 * s * (n * u32 / (1 - n * u32) * a) + (2 * u32 + u32 ^ 2) * s * a)
      with (((1 + u32) ^ 2 * (n * u32 / (1 - n * u32)) + 2 * u32 + u32 ^ 2) * (s * a)) by (field; lra).
    replace ((n + 4) * u32 * (101 / 100) * s * a) with ((n + 4) * u32 * (101 / 100) * (s * a)) by field.
    apply Rmult_le_compat_r; [apply Rmult_le_pos; lra|lra]. }
  assert (H2 : (1 + u32) ^ 2 * s * ((2 * n - 1) * eta32 / (1 - n * u32)) <= (202 / 100) * n * s * eta32).
  { replace ((1 + u32) ^ 2 * s * ((2 * n - 1) * eta32 / (1 - n * u32)))
      with ((1 + u32) ^ 2 * (2 * n - 1) / (1 - n * u32) * (s * eta32)) by (field; lra).
    replace ((202 / 100) * n * s * eta32) with ((202 / 100) * n * (s * eta32)) by field.
    apply Rmult_le_compat_r; [apply Rmult_le_pos; lra|lra]. }
  replace ((1 + u32) ^ 2 * s * (n * u32 / (1 - n * u32) * a + (2 * n - 1) * eta32 / (1 - n * u32)))
    with ((1 + u32) ^ 2 * s * (n * u32 / (1 - n * u32) * a)
          + (1 + u32) ^ 2 * s * ((2 * n - 1) * eta32 / (1 - n * u32))) by (field; lra).
  lra.
Qed.

(** T8f: a binary32 or binary64 sum of n nonnegative floats in any tree order is at most
    (1 + u)^(n-1) times the exact sum, so computed * (1 - gamma_n) <= exact: the direction
    the lower bounds on Z, M and B' need. *)
Theorem computed_mul_one_sub_gamma_le_exact_f32 choice t :
  INR (size t) * u32 < 1 -> leaves_nonneg_f32 t ->
  ftree choice t * (1 - gamma32 (size t)) <= exact_tree t.
Proof.
  intros Hn Ht. rewrite gamma32_eq. rewrite u32_eq in Hn.
  exact (computed_mul_one_sub_gamma_le_exact_fmt (-149) 24 prec32_gt_0 choice t Hn Ht).
Qed.

Theorem computed_mul_one_sub_gamma_le_exact_f64 choice t :
  INR (size t) * u64 < 1 -> leaves_nonneg_f64 t ->
  ftree64 choice t * (1 - gamma64 (size t)) <= exact_tree t.
Proof.
  intros Hn Ht. rewrite gamma64_eq. rewrite u64_eq in Hn.
  exact (computed_mul_one_sub_gamma_le_exact_fmt (-1074) 53 prec64_gt_0 choice t Hn Ht).
Qed.

Lemma code_factor_le_scaled u n :
  0 < u -> u <= / 1000000 -> 0 <= n -> 200 * (n * u) <= 1 ->
  (1 + u) ^ 4 * (n * u / (1 - n * u)) + ((1 + u) ^ 2 + 1) * (2 * u + u ^ 2)
    <= (n + 4) * u * (101 / 100)
  /\ (1 + u) ^ 4 * (2 * n - 1) / (1 - n * u) <= (202 / 100) * n
  /\ (1 + u) ^ 2 <= 101 / 100.
Proof.
  intros Hu Hu1 Hn Hw.
  assert (Hsq : (1 + u) ^ 2 <= 1 + 3 * u) by nra.
  assert (Hsq1 : 1 <= (1 + u) ^ 2) by nra.
  assert (H4 : (1 + u) ^ 4 = (1 + u) ^ 2 * (1 + u) ^ 2) by ring.
  destruct (code_factor_gen u n ((1 + u) ^ 4) ((1 + u) ^ 2 + 1) Hu Hu1 Hn Hw) as [H1 H2];
    [rewrite H4; split; nra|lra|].
  split; [exact H1|split; [exact H2|lra]].
Qed.

(** T8e, int8 path with one scale per token (k~ = m sc exactly, fast.core.attention applies
    the scale to the dot product): x^ = fl(fl(fl(q . m) * sc) * s32). The relative part stays
    inside the code's (D + 4) u 1.01; the absolute part is (2.02 D s sc + 1.01 s + 1) 2^-150,
    which fast.core.attention covers by adding (2.03 D s sc_max + 1.02 s) 2^-150 to e. *)
Theorem logit_rounding_le_code_f32_scaled choice q m t sc s s32 :
  200 * (INR (dterms t) * u32) <= 1 -> 0 <= sc -> 0 <= s -> Rabs (s32 - s) <= u32 * s ->
  Rabs (rn32 choice (rn32 choice (dcomp32 choice q m t * sc) * s32) - s * (sc * dexact q m t))
  <= (INR (dterms t) + 4) * u32 * (101 / 100) * s * (sc * dabs q m t)
     + ((202 / 100) * INR (dterms t) * s * sc + (101 / 100) * s + 1) * eta32.
Proof.
  intros Hn Hsc Hs Hs32.
  destruct u32_small as [Hu Hu1].
  assert (Hn0 := pos_INR (dterms t)).
  destruct (code_factor_le_scaled u32 (INR (dterms t)) Hu Hu1 Hn0 Hn) as [Hrel [Habs Hsq]].
  assert (Hd := abs_fdot_sub_le_f32 choice q m t ltac:(lra)).
  assert (Ha := dabs_nonneg q m t). assert (HS := abs_dexact_le_dabs q m t).
  rewrite u32_eq in Hs32.
  assert (Hsc0 : Rabs (sc - sc) <= u_fmt 24 * sc).
  { rewrite Rminus_diag_eq, Rabs_R0 by reflexivity. pose proof (u_fmt_pos 24). nra. }
  assert (H1 := abs_rn_scaled_sub_le (-149) 24 prec32_gt_0 choice
                  (dcomp32 choice q m t) (dexact q m t) sc sc _ _ Hsc Hsc0 Hd HS).
  assert (HS1 : Rabs (sc * dexact q m t) <= sc * dabs q m t).
  { rewrite Rabs_mult, Rabs_pos_eq by lra. apply Rmult_le_compat_l; lra. }
  fold (rn32 choice (dcomp32 choice q m t * sc)) in H1.
  assert (H2 := abs_rn_scaled_sub_le (-149) 24 prec32_gt_0 choice
                  (rn32 choice (dcomp32 choice q m t * sc)) (sc * dexact q m t) s s32 _ _ Hs Hs32 H1 HS1).
  fold (rn32 choice (rn32 choice (dcomp32 choice q m t * sc) * s32)) in H2.
  rewrite <- u32_eq, <- eta32_eq in H2.
  eapply Rle_trans; [exact H2|].
  unfold gamma32 in *.
  set (n := INR (dterms t)) in *. set (a := dabs q m t) in *.
  assert (He : 0 < eta32) by (unfold eta32; apply Rinv_0_lt_compat; apply pow_lt; lra).
  set (g := n * u32 / (1 - n * u32)) in *.
  set (h := (2 * n - 1) * eta32 / (1 - n * u32)).
  assert (Hh : (1 + u32) ^ 4 * (s * sc) * h <= (202 / 100) * n * s * sc * eta32).
  { unfold h. replace ((1 + u32) ^ 4 * (s * sc) * ((2 * n - 1) * eta32 / (1 - n * u32)))
      with ((1 + u32) ^ 4 * (2 * n - 1) / (1 - n * u32) * (s * sc * eta32)) by (field; lra).
    replace ((202 / 100) * n * s * sc * eta32) with ((202 / 100) * n * (s * sc * eta32)) by field.
    apply Rmult_le_compat_r; [|lra]. apply Rmult_le_pos; [apply Rmult_le_pos|]; lra. }
  assert (Hg : ((1 + u32) ^ 4 * g + ((1 + u32) ^ 2 + 1) * (2 * u32 + u32 ^ 2)) * (s * sc * a)
               <= (n + 4) * u32 * (101 / 100) * (s * sc * a)).
  { apply Rmult_le_compat_r; [|lra]. apply Rmult_le_pos; [apply Rmult_le_pos|]; lra. }
  assert (Hs2 : (1 + u32) ^ 2 * s * eta32 <= (101 / 100) * s * eta32).
  { replace ((1 + u32) ^ 2 * s * eta32) with ((1 + u32) ^ 2 * (s * eta32)) by ring.
    replace ((101 / 100) * s * eta32) with ((101 / 100) * (s * eta32)) by field.
    apply Rmult_le_compat_r; [apply Rmult_le_pos|]; lra. }
  replace ((1 + u32) ^ 2 * s * ((1 + u32) ^ 2 * sc * (g * a + h) + (2 * u32 + u32 ^ 2) * sc * a + eta32)
           + (2 * u32 + u32 ^ 2) * s * (sc * a) + eta32)
    with (((1 + u32) ^ 4 * g + ((1 + u32) ^ 2 + 1) * (2 * u32 + u32 ^ 2)) * (s * sc * a)
          + (1 + u32) ^ 4 * (s * sc) * h + (1 + u32) ^ 2 * s * eta32 + eta32) by ring.
  replace ((n + 4) * u32 * (101 / 100) * s * (sc * a)
           + ((202 / 100) * n * s * sc + (101 / 100) * s + 1) * eta32)
    with ((n + 4) * u32 * (101 / 100) * (s * sc * a) + (202 / 100) * n * s * sc * eta32
          + (101 / 100) * s * eta32 + eta32) by field.
  lra.
Qed.
