(** T5c-T5d: what is served. The certificate bounds TV(p, softmax(x^)) for the fp32 logits x^;
    the server's weights are the computed w_j ~ e^{x^_j - m}, normalised: TV to them adds the
    weights' rounding (T5c). The output is a signed fp32 dot product divided by a computed sum:
    one rounded quotient of two perturbed numbers (T5d; the dot product itself is T8d). *)
From Coq Require Import Reals Lra Lia.
From Flocq Require Import Core.
From KVCert Require Import Prelim Float FloatDot.
Open Scope R_scope.

(** * T5c: TV to the served weights *)

Theorem tv_triangle n p q r : tv n p r <= tv n p q + tv n q r.
Proof.
  unfold tv. rewrite <- Rmult_plus_distr_l, <- sum_add.
  apply Rmult_le_compat_l; [lra|]. apply sum_le. intros j _.
  replace (p j - r j) with ((p j - q j) + (q j - r j)) by ring. apply Rabs_triang.
Qed.

(** Normalising two nonnegative-sum vectors: TV(a / sum a, w / sum w) <= sum |w - a| / sum a. *)
Lemma tv_normalized_le n (a w : nat -> R) :
  (forall j, (j < n)%nat -> 0 <= w j) -> 0 < sum n a -> 0 < sum n w ->
  tv n (fun j => a j / sum n a) (fun j => w j / sum n w)
  <= sum n (fun j => Rabs (w j - a j)) / sum n a.
Proof.
  intros Hw HA HW.
  set (A := sum n a) in *. set (W := sum n w) in *.
  set (S := sum n (fun j => Rabs (w j - a j))).
  assert (HWA : Rabs (W - A) <= S).
  { unfold W, A, S. rewrite <- sum_sub.
    eapply Rle_trans; [apply sum_abs_le|]. apply Req_le. reflexivity. }
  assert (Hj : forall j, (j < n)%nat ->
            Rabs (a j / A - w j / W) <= Rabs (w j - a j) / A + w j * (Rabs (W - A) / (A * W))).
  { intros j Hjn.
    replace (a j / A - w j / W) with ((a j - w j) / A + w j * ((W - A) / (A * W))) by (field; lra).
    eapply Rle_trans; [apply Rabs_triang|]. apply Rplus_le_compat.
    - unfold Rdiv. rewrite Rabs_mult, Rabs_minus_sym, (Rabs_pos_eq (/ A)); [lra|].
      left. apply Rinv_0_lt_compat. lra.
    - rewrite Rabs_mult, (Rabs_pos_eq (w j)) by (apply Hw; exact Hjn).
      unfold Rdiv. rewrite Rabs_mult, (Rabs_pos_eq (/ (A * W))); [lra|].
      left. apply Rinv_0_lt_compat. nra. }
  unfold tv.
  apply Rle_trans with (/ 2 * sum n (fun j => Rabs (w j - a j) / A + w j * (Rabs (W - A) / (A * W)))).
  - apply Rmult_le_compat_l; [lra|]. apply sum_le. exact Hj.
  - rewrite sum_add, sum_scal_r.
    unfold Rdiv at 1. rewrite sum_scal_r. fold S. fold W.
    replace (W * (Rabs (W - A) / (A * W))) with (Rabs (W - A) / A) by (field; lra).
    assert (Rabs (W - A) / A <= S / A) by (apply Rmult_le_compat_r; [left; apply Rinv_0_lt_compat; lra|exact HWA]).
    unfold Rdiv in *. lra.
Qed.

(** Per-weight errors |w_j - a_j| <= eta a_j + beta (relative above the normal range, absolute
    below) give TV(a / sum a, w / sum w) <= eta + n beta / sum a. *)
Theorem tv_normalized_le_of_rel_abs n (a w : nat -> R) eta beta :
  (forall j, (j < n)%nat -> 0 <= a j) -> (forall j, (j < n)%nat -> 0 <= w j) ->
  0 < sum n a -> 0 < sum n w ->
  (forall j, (j < n)%nat -> Rabs (w j - a j) <= eta * a j + beta) ->
  tv n (fun j => a j / sum n a) (fun j => w j / sum n w) <= eta + INR n * beta / sum n a.
Proof.
  intros Ha Hw HA HW He.
  eapply Rle_trans; [apply tv_normalized_le; assumption|].
  assert (HS : sum n (fun j => Rabs (w j - a j)) <= eta * sum n a + INR n * beta).
  { rewrite <- sum_scal_l, <- sum_const, <- sum_add. apply sum_le. exact He. }
  apply Rle_trans with ((eta * sum n a + INR n * beta) / sum n a).
  - apply Rmult_le_compat_r; [left; apply Rinv_0_lt_compat; lra|exact HS].
  - right. field. lra.
Qed.

(** The reported bound: a certificate t >= TV(p, a / sum a) for the exact weights of the fp32
    logits (a_j = e^{x^_j - m}, sum a >= 1: the argmax term), plus the weights' rounding, bounds the
    TV to the served weights w / sum w. *)
Theorem tv_served_le n (p a w : nat -> R) t eta beta :
  (forall j, (j < n)%nat -> 0 <= a j) -> (forall j, (j < n)%nat -> 0 <= w j) ->
  1 <= sum n a -> 0 < sum n w -> 0 <= beta ->
  (forall j, (j < n)%nat -> Rabs (w j - a j) <= eta * a j + beta) ->
  tv n p (fun j => a j / sum n a) <= t ->
  tv n p (fun j => w j / sum n w) <= t + eta + INR n * beta.
Proof.
  intros Ha Hw HA HW Hb He Ht.
  eapply Rle_trans; [apply (tv_triangle n p (fun j => a j / sum n a))|].
  assert (Hr := tv_normalized_le_of_rel_abs n a w eta beta Ha Hw ltac:(lra) HW He).
  assert (Hnb : INR n * beta / sum n a <= INR n * beta).
  { assert (0 <= INR n * beta) by (apply Rmult_le_pos; [apply pos_INR|exact Hb]).
    unfold Rdiv. rewrite <- (Rmult_1_r (INR n * beta)) at 2.
    apply Rmult_le_compat_l; [lra|].
    rewrite <- Rinv_1. apply Rinv_le_contravar; lra. }
  lra.
Qed.

(** * T5d: the output's quotient *)

Section Format.

Variables emin prec : Z.
Hypothesis prec_gt_0_ : Prec_gt_0 prec.

Notation rn := (rn_fmt emin prec).
Notation u := (u_fmt prec).
Notation eta := (eta_fmt emin).

(** out_i = rn(Sh / Wh) for a computed signed sum Sh (|Sh - S| <= E, T8d) and a computed weight
    sum Wh (|Wh - W| <= g W, T8a / T8f), with |S| <= V W (V >= max_j |v_j|):
    |out_i - S / W| <= (1 + u) (E + g V W) / ((1 - g) W) + u V + eta. *)
Theorem out_quotient_le choice Sh S Wh W E V g :
  0 < W -> 0 <= g < 1 -> Rabs (Wh - W) <= g * W -> Rabs (Sh - S) <= E -> Rabs S <= V * W ->
  Rabs (rn choice (Sh / Wh) - S / W)
  <= (1 + u) * ((E + g * V * W) / ((1 - g) * W)) + u * V + eta.
Proof.
  intros HW Hg HWh HE HS.
  pose proof (u_fmt_pos prec) as Hu.
  assert (HWl : (1 - g) * W <= Wh) by (apply Rabs_le_inv in HWh; lra).
  assert (HWp : 0 < (1 - g) * W) by nra.
  assert (HWh0 : 0 < Wh) by lra.
  assert (HE0 : 0 <= E) by (eapply Rle_trans; [apply Rabs_pos|exact HE]).
  assert (HV0 : 0 <= V).
  { assert (0 <= V * W) by (eapply Rle_trans; [apply Rabs_pos|exact HS]).
    destruct (Rle_lt_dec 0 V); [lra|nra]. }
  set (y := Sh / Wh).
  set (d := (E + g * V * W) / ((1 - g) * W)).
  assert (Hd : Rabs (y - S / W) <= d).
  { unfold y, d.
    replace (Sh / Wh - S / W) with ((Sh - S) / Wh + S * (W - Wh) / (Wh * W)) by (field; lra).
    eapply Rle_trans; [apply Rabs_triang|].
    unfold Rdiv. rewrite !Rabs_mult, (Rabs_pos_eq (/ Wh)), (Rabs_pos_eq (/ (Wh * W))).
    2: { left. apply Rinv_0_lt_compat. nra. }
    2: { left. apply Rinv_0_lt_compat. lra. }
    assert (Hi1 : / Wh <= / ((1 - g) * W)) by (apply Rinv_le_contravar; lra).
    assert (Hi2 : / (Wh * W) <= / ((1 - g) * W * W)) by (apply Rinv_le_contravar; nra).
    assert (HWd : Rabs (W - Wh) <= g * W) by (rewrite Rabs_minus_sym; exact HWh).
    assert (T1 : Rabs (Sh - S) * / Wh <= E * / ((1 - g) * W)).
    { apply Rmult_le_compat; try lra; [apply Rabs_pos|left; apply Rinv_0_lt_compat; lra]. }
    assert (T2 : Rabs S * Rabs (W - Wh) * / (Wh * W) <= V * W * (g * W) * / ((1 - g) * W * W)).
    { apply Rmult_le_compat; [apply Rmult_le_pos; apply Rabs_pos|left; apply Rinv_0_lt_compat; nra| |exact Hi2].
      apply Rmult_le_compat; [apply Rabs_pos|apply Rabs_pos|exact HS|exact HWd]. }
    replace ((E + g * V * W) * / ((1 - g) * W))
      with (E * / ((1 - g) * W) + V * W * (g * W) * / ((1 - g) * W * W)) by (field; lra).
    lra. }
  assert (Hd0 : 0 <= d) by (eapply Rle_trans; [apply Rabs_pos|exact Hd]).
  assert (Hy : Rabs y <= V + d).
  { replace y with (S / W + (y - S / W)) by ring. eapply Rle_trans; [apply Rabs_triang|].
    unfold Rdiv. rewrite Rabs_mult, (Rabs_pos_eq (/ W)) by (left; apply Rinv_0_lt_compat; lra).
    assert (Rabs S * / W <= V).
    { apply Rmult_le_reg_r with W; [lra|]. rewrite Rmult_assoc, Rinv_l, Rmult_1_r by lra. exact HS. }
    lra. }
  pose proof (abs_rn_sub_le emin prec prec_gt_0_ choice y) as Hrn.
  replace (rn choice y - S / W) with ((rn choice y - y) + (y - S / W)) by ring.
  eapply Rle_trans; [apply Rabs_triang|].
  assert (u * Rabs y <= u * (V + d)) by (apply Rmult_le_compat_l; lra).
  fold d. lra.
Qed.

End Format.

(** The binary32 instance (the served output of fast.core.attention). *)
Theorem out_quotient_le_f32 choice Sh S Wh W E V g :
  0 < W -> 0 <= g < 1 -> Rabs (Wh - W) <= g * W -> Rabs (Sh - S) <= E -> Rabs S <= V * W ->
  Rabs (rn32 choice (Sh / Wh) - S / W)
  <= (1 + u32) * ((E + g * V * W) / ((1 - g) * W)) + u32 * V + eta32.
Proof.
  intros. rewrite u32_eq, eta32_eq. apply out_quotient_le; auto. exact prec32_gt_0.
Qed.
