(** Floating-point casts of the codecs (fast/core/quant.py): the error of rounding a real
    y to a binary format with precision [prec] and smallest exponent [emin] (gradual
    underflow, no overflow), bounded in terms of the RESULT c (what the cache stores, so what
    the zero-memory witness can see): |c - y| <= 2^(1-prec) |c| + 2^emin for ANY rounding
    (round toward zero included, as vLLM's CPU fp8 cast), half of it for round-to-nearest.
    Instantiated for fp8 e4m3 (prec 4, emin -9) and e5m2 (prec 3, emin -16). *)
From Coq Require Import Reals Lra Lia.
From Flocq Require Import Core.
Open Scope R_scope.

Section Cast.
Variables emin prec : Z.
Context {prec_gt_0_ : Prec_gt_0 prec}.

Lemma ulp_le_rel_add_abs x :
  ulp radix2 (FLT_exp emin prec) x <= bpow radix2 (1 - prec) * Rabs x + bpow radix2 emin.
Proof.
  assert (H1 := bpow_gt_0 radix2 emin).
  assert (H2 : 0 <= bpow radix2 (1 - prec) * Rabs x)
    by (apply Rmult_le_pos; [apply bpow_ge_0|apply Rabs_pos]).
  destruct (Rle_lt_dec (bpow radix2 (emin + prec - 1)) (Rabs x)) as [Hx|Hx].
  - assert (H := ulp_FLT_le radix2 emin prec x Hx). rewrite Rmult_comm in H. lra.
  - rewrite ulp_FLT_small; [lra|exact prec_gt_0_|].
    apply Rlt_le_trans with (1 := Hx). apply bpow_le. lia.
Qed.

(** Any rounding (toward zero, away, up, down, nearest): the cast error is below one ulp of
    the result, |c - y| <= 2^(1-prec) |c| + 2^emin. *)
Theorem cast_error_le_of_valid_rnd (rnd : R -> Z) {valid_rnd_ : Valid_rnd rnd} y :
  Rabs (round radix2 (FLT_exp emin prec) rnd y - y)
  <= bpow radix2 (1 - prec) * Rabs (round radix2 (FLT_exp emin prec) rnd y) + bpow radix2 emin.
Proof.
  destruct (Req_dec y 0) as [->|Hy].
  - rewrite round_0 by exact valid_rnd_. rewrite Rminus_0_r, Rabs_R0, Rmult_0_r, Rplus_0_l.
    apply bpow_ge_0.
  - left. eapply Rlt_le_trans; [apply error_lt_ulp_round; auto with typeclass_instances; exact Hy|].
    apply ulp_le_rel_add_abs.
Qed.

(** Round to nearest (any tie rule): half of it, |c - y| <= (2^(1-prec) |c| + 2^emin) / 2. *)
Theorem cast_error_le_of_nearest (choice : Z -> bool) y :
  Rabs (round radix2 (FLT_exp emin prec) (Znearest choice) y - y)
  <= / 2 * (bpow radix2 (1 - prec) * Rabs (round radix2 (FLT_exp emin prec) (Znearest choice) y)
            + bpow radix2 emin).
Proof.
  eapply Rle_trans; [apply error_le_half_ulp_round; auto with typeclass_instances|].
  apply Rmult_le_compat_l; [lra|]. apply ulp_le_rel_add_abs.
Qed.

End Cast.

(** fp8 e4m3 (torch.float8_e4m3fn: 3 stored mantissa bits, smallest subnormal 2^-9), round
    to nearest: |c - y| <= 2^-4 |c| + 2^-10 (fast/core/quant.py FP8: u8 = 2^-4, a8 = 2^-10). *)
Theorem fp8_e4m3_cast_error_le_nearest (choice : Z -> bool) y :
  Rabs (round radix2 (FLT_exp (-9) 4) (Znearest choice) y - y)
  <= / 16 * Rabs (round radix2 (FLT_exp (-9) 4) (Znearest choice) y) + / 1024.
Proof.
  eapply Rle_trans; [apply cast_error_le_of_nearest; reflexivity|].
  simpl bpow. unfold Z.pow_pos. simpl. lra.
Qed.

(** fp8 e4m3 truncated toward zero (vLLM's CPU cast): twice the nearest bound,
    |c - y| <= 2^-3 |c| + 2^-9. *)
Theorem fp8_e4m3_cast_error_le_toward_zero y :
  Rabs (round radix2 (FLT_exp (-9) 4) Ztrunc y - y)
  <= / 8 * Rabs (round radix2 (FLT_exp (-9) 4) Ztrunc y) + / 512.
Proof.
  eapply Rle_trans; [apply cast_error_le_of_valid_rnd; [reflexivity|auto with typeclass_instances]|].
  simpl bpow. unfold Z.pow_pos. simpl. lra.
Qed.

(** fp8 e5m2 (2 stored mantissa bits, smallest subnormal 2^-16), round to nearest:
    |c - y| <= 2^-3 |c| + 2^-17 (u8 = 2^-3, a8 = 2^-17 in fast/core/quant.py). *)
Theorem fp8_e5m2_cast_error_le_nearest (choice : Z -> bool) y :
  Rabs (round radix2 (FLT_exp (-16) 3) (Znearest choice) y - y)
  <= / 8 * Rabs (round radix2 (FLT_exp (-16) 3) (Znearest choice) y) + / 131072.
Proof.
  eapply Rle_trans; [apply cast_error_le_of_nearest; reflexivity|].
  simpl bpow. unfold Z.pow_pos. simpl. lra.
Qed.

(** fp8 e5m2 truncated toward zero: |c - y| <= 2^-2 |c| + 2^-16. *)
Theorem fp8_e5m2_cast_error_le_toward_zero y :
  Rabs (round radix2 (FLT_exp (-16) 3) Ztrunc y - y)
  <= / 4 * Rabs (round radix2 (FLT_exp (-16) 3) Ztrunc y) + / 65536.
Proof.
  eapply Rle_trans; [apply cast_error_le_of_valid_rnd; [reflexivity|auto with typeclass_instances]|].
  simpl bpow. unfold Z.pow_pos. simpl. lra.
Qed.
