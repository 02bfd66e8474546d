(** A7 in part: the round trip of the integer codecs int8 and int4 (fast/core/quant.py,
    per-group absmax with an fp16 scale, no dither) with the code's own fp32 operations:
    y = fl32(x / sc), m = round(y) (the clamp never binds), x~ = fl32(m * sc). *)
From Coq Require Import Reals Lra Lia.
From Flocq Require Import Core.
From KVCert Require Import Prelim Float FloatDot.
Open Scope R_scope.

(** An integer below 2^24 times a power of two at least 2^-149 is a binary32 number. *)
Lemma is_f32_int_mul_bpow (N e : Z) :
  (Z.abs N < 16777216)%Z -> (-149 <= e)%Z -> is_f32 (IZR N * bpow radix2 e).
Proof.
  intros HN He. unfold is_f32, is_fmt. apply generic_format_FLT.
  apply FLT_spec with (f := Float radix2 N e); [reflexivity| |simpl; lia].
  simpl. lia.
Qed.

Lemma rn32_of_f32 choice x : is_f32 x -> rn32 choice x = x.
Proof.
  intros Hx. unfold rn32, rn_fmt. apply round_generic; [|exact Hx].
  apply valid_rnd_N.
Qed.

(** The code's round trip for one coordinate: sc an fp16 scale (11-bit significand M,
    exponent >= -24) with |x| <= qmax (1 + v) sc, y = fl32(x / sc) and a code m within 1/2 of y
    (round half to even), |m| <= 256. Then x~ = fl32(m sc) = m sc exactly and
    |x - x~| <= sc (1/2 + u qmax (1 + v) + 2^-150). *)
Theorem int_codec_err_le choice x (M e m : Z) qmax v :
  (0 < M < 2048)%Z -> (-24 <= e)%Z -> (Z.abs m <= 256)%Z -> 0 <= v ->
  Rabs x <= qmax * (1 + v) * (IZR M * bpow radix2 e) ->
  Rabs (rn32 choice (x / (IZR M * bpow radix2 e)) - IZR m) <= / 2 ->
  Rabs (x - rn32 choice (IZR m * (IZR M * bpow radix2 e)))
  <= IZR M * bpow radix2 e * (/ 2 + u32 * qmax * (1 + v) + eta32).
Proof.
  intros HM He Hm Hv Hx Hy.
  set (sc := IZR M * bpow radix2 e) in *.
  assert (Hsc : 0 < sc).
  { unfold sc. apply Rmult_lt_0_compat; [apply IZR_lt; lia|apply bpow_gt_0]. }
  assert (Hexact : rn32 choice (IZR m * sc) = IZR m * sc).
  { apply rn32_of_f32. unfold sc. rewrite <- Rmult_assoc, <- mult_IZR.
    apply is_f32_int_mul_bpow; [|lia].
    rewrite Z.abs_mul. assert (Z.abs M < 2048)%Z by lia.
    assert (0 <= Z.abs m)%Z by lia. assert (0 <= Z.abs M)%Z by lia. nia. }
  rewrite Hexact.
  assert (Hq : 0 <= qmax * (1 + v)).
  { assert (0 <= qmax * (1 + v) * sc) by (eapply Rle_trans; [apply Rabs_pos|exact Hx]).
    apply Rmult_le_reg_r with sc; [exact Hsc|]. lra. }
  assert (Hxs : Rabs (x / sc) <= qmax * (1 + v)).
  { unfold Rdiv. rewrite Rabs_mult, (Rabs_pos_eq (/ sc)) by (left; apply Rinv_0_lt_compat; lra).
    apply Rmult_le_reg_r with sc; [exact Hsc|]. rewrite Rmult_assoc, Rinv_l by lra. lra. }
  pose proof (abs_rn_sub_le (-149) 24 prec32_gt_0 choice (x / sc)) as Hr.
  rewrite <- u32_eq, <- eta32_eq in Hr. fold (rn32 choice (x / sc)) in Hr.
  assert (Hu : 0 < u32) by (apply u32_small).
  assert (Hd : Rabs (x / sc - IZR m) <= / 2 + u32 * qmax * (1 + v) + eta32).
  { replace (x / sc - IZR m) with ((rn32 choice (x / sc) - IZR m) - (rn32 choice (x / sc) - x / sc)) by ring.
    eapply Rle_trans; [apply Rabs_triang|]. rewrite Rabs_Ropp.
    assert (u32 * Rabs (x / sc) <= u32 * (qmax * (1 + v))) by (apply Rmult_le_compat_l; lra).
    lra. }
  replace (x - IZR m * sc) with (sc * (x / sc - IZR m)) by (field; lra).
  rewrite Rabs_mult, (Rabs_pos_eq sc) by lra.
  apply Rmult_le_compat_l; lra.
Qed.

(** The code's constant: for int8 (qmax = 127) and int4 (qmax = 7), with the fp64 scale
    division rounded (v <= 2^-52), the error is within half the code's step
    sc * STEP_MARGIN = sc (1 + 2^-10), i.e. |x - x~| <= step / 2. *)
Theorem int_codec_err_le_half_step choice x (M e m : Z) qmax v :
  (0 < M < 2048)%Z -> (-24 <= e)%Z -> (Z.abs m <= 256)%Z -> 0 <= v -> v <= / 2 ^ 52 ->
  qmax <= 127 ->
  Rabs x <= qmax * (1 + v) * (IZR M * bpow radix2 e) ->
  Rabs (rn32 choice (x / (IZR M * bpow radix2 e)) - IZR m) <= / 2 ->
  Rabs (x - rn32 choice (IZR m * (IZR M * bpow radix2 e)))
  <= IZR M * bpow radix2 e * (1 + / 2 ^ 10) / 2.
Proof.
  intros HM He Hm Hv Hv1 Hq Hx Hy.
  eapply Rle_trans; [apply (int_codec_err_le choice x M e m qmax v); assumption|].
  assert (Hsc : 0 < IZR M * bpow radix2 e).
  { apply Rmult_lt_0_compat; [apply IZR_lt; lia|apply bpow_gt_0]. }
  destruct u32_small as [Hu Hu1].
  assert (Hq0 : 0 <= qmax * (1 + v)).
  { assert (0 <= qmax * (1 + v) * (IZR M * bpow radix2 e))
      by (eapply Rle_trans; [apply Rabs_pos|exact Hx]).
    apply Rmult_le_reg_r with (IZR M * bpow radix2 e); [exact Hsc|]. lra. }
  assert (Hv2 : v <= 1) by (assert (0 < / 2 ^ 52) by (apply Rinv_0_lt_compat, pow_lt; lra);
                             assert (/ 2 ^ 52 <= 1) by (rewrite <- Rinv_1; apply Rinv_le_contravar; [lra|];
                                                       apply pow_R1_Rle; lra); lra).
  assert (Hqv : qmax * (1 + v) <= 254).
  { destruct (Rle_lt_dec 0 qmax) as [Hq1|Hq1]; [nra|]. nra. }
  assert (He32 : eta32 <= / 1000000).
  { unfold eta32. apply Rinv_le_contravar; [lra|]. simpl. lra. }
  assert (He0 : 0 < eta32) by (unfold eta32; apply Rinv_0_lt_compat; apply pow_lt; lra).
  assert (Hp : / 2 ^ 10 = / 1024) by (simpl; field).
  rewrite Hp.
  assert (Huq : u32 * (qmax * (1 + v)) <= / 1000000 * 254) by (apply Rmult_le_compat; lra).
  replace (IZR M * bpow radix2 e * (1 + / 1024) / 2)
    with (IZR M * bpow radix2 e * (/ 2 + / 2048)) by field.
  apply Rmult_le_compat_l; [lra|]. lra.
Qed.
