(** T6g-T6j for b-bit codes. DitherGrid.v proves the grid theorems for ANY nondecreasing integer
    rounding within 1/2 + eta of its argument: no code range enters them. The 8-bit code entered
    only through the code's clamp of m to [-127, 127] and its scale choice |y| <= 126.5 (argued by
    hand, spec A6/A7). Here the clamp is part of the statement: the code of a coordinate is
    m = clamp(rnd(y + u)) into the b-bit range, signed symmetric [-(2^(b-1) - 1), 2^(b-1) - 1]
    (int8_dither, int4_dither) or unsigned [0, 2^b - 1] (kivi2_dither), for every b >= 1. When the
    scaled input y lies in the code range, widened by 1/(2N) - eta, the clamp never binds at any
    grid point, so all of T6g-T6j hold for the clamped code; when y lies a whole step outside it,
    every grid error is below -(1/2 + 1/(2N)) and the law fails (the code must refuse, never clamp). *)
From Coq Require Import Reals Lra Lia ZArith.
From Flocq Require Import Core.
From KVCert Require Import Prelim Dither DitherGrid Float FloatDot.
Open Scope R_scope.

(** * b-bit code ranges *)

Definition code_lo (signed : bool) (b : nat) : Z :=
  if signed then (1 - 2 ^ (Z.of_nat b - 1))%Z else 0%Z.
Definition code_hi (signed : bool) (b : nat) : Z :=
  if signed then (2 ^ (Z.of_nat b - 1) - 1)%Z else (2 ^ Z.of_nat b - 1)%Z.

(** The stored code: the rounding clamped into the b-bit range. *)
Definition bcode (signed : bool) (b : nat) (rnd : R -> Z) (z : R) : Z :=
  Z.max (code_lo signed b) (Z.min (code_hi signed b) (rnd z)).

(** The scaled input lies in the code range, widened by 1/(2N) - eta on each side. *)
Definition in_code_range (signed : bool) (b N : nat) (eta y : R) : Prop :=
  IZR (code_lo signed b) - (/ (2 * INR N) - eta) < y /\
  y < IZR (code_hi signed b) + (/ (2 * INR N) - eta).

(** The ranges are b-bit codes: nonempty, at most 2^b values. *)
Theorem code_range_fits_b_bits signed b :
  (1 <= b)%nat ->
  (code_lo signed b <= code_hi signed b /\ code_hi signed b - code_lo signed b + 1 <= 2 ^ Z.of_nat b)%Z.
Proof.
  intros Hb.
  assert (Hp : (0 < 2 ^ (Z.of_nat b - 1))%Z) by (apply Z.pow_pos_nonneg; lia).
  assert (Hd : (2 ^ Z.of_nat b = 2 * 2 ^ (Z.of_nat b - 1))%Z).
  { replace (Z.of_nat b) with (Z.of_nat b - 1 + 1)%Z at 1 by lia.
    rewrite Z.pow_add_r by lia. lia. }
  unfold code_lo, code_hi. destruct signed; lia.
Qed.

Lemma bcode_mono signed b rnd :
  (forall a c, a <= c -> (rnd a <= rnd c)%Z) ->
  forall a c, a <= c -> (bcode signed b rnd a <= bcode signed b rnd c)%Z.
Proof. intros H a c Hac. unfold bcode. assert (Hr := H a c Hac). lia. Qed.

Lemma grid_u_bounds N i :
  (0 < N)%nat -> (i < N)%nat ->
  - / 2 + / (2 * INR N) <= grid_u N i <= / 2 - / (2 * INR N).
Proof.
  intros HN Hi.
  assert (HNr : 0 < INR N) by (apply lt_0_INR; lia).
  assert (Hi' : INR i + 1 <= INR N) by (rewrite <- S_INR; apply le_INR; lia).
  assert (H0 : 0 <= INR i) by apply pos_INR.
  replace (grid_u N i) with (- / 2 + / (2 * INR N) + INR i / INR N) by (unfold grid_u; field; lra).
  assert (0 <= INR i / INR N) by (unfold Rdiv; apply Rmult_le_pos; [lra|left; apply Rinv_0_lt_compat; lra]).
  assert (INR i / INR N <= (INR N - 1) / INR N).
  { unfold Rdiv. apply Rmult_le_compat_r; [left; apply Rinv_0_lt_compat; lra|lra]. }
  replace ((INR N - 1) / INR N) with (1 - / INR N) in * by (field; lra).
  replace (/ (2 * INR N)) with (/ 2 * / INR N) by (field; lra).
  split; lra.
Qed.

Lemma clamp_eq_of_close (lo hi m : Z) (eta z : R) :
  Rabs (IZR m - z) <= / 2 + eta -> IZR lo - / 2 + eta < z -> z < IZR hi + / 2 - eta ->
  Z.max lo (Z.min hi m) = m.
Proof.
  intros Hc Hlo Hhi. apply Rabs_le_inv in Hc.
  assert (H1 : (lo - 1 < m)%Z) by (apply lt_IZR; rewrite minus_IZR; simpl; lra).
  assert (H2 : (m < hi + 1)%Z) by (apply lt_IZR; rewrite plus_IZR; simpl; lra).
  lia.
Qed.

Section Code.
Variables (N : nat) (signed : bool) (b : nat).
Hypothesis HN : (0 < N)%nat.
Variable rnd : R -> Z.
Hypothesis R_mono : forall a c, a <= c -> (rnd a <= rnd c)%Z.
Variable eta : R.
Hypothesis eta_nonneg : 0 <= eta.
Hypothesis eta_lt : 2 * eta < / INR N.
(** The rounding need be close only within a step of the code range, where the code evaluates it
    (fl32's half ulp there: 2^-18 for int8, 2^-22 for int4 and 2-bit codes). *)
Hypothesis R_close : forall z, IZR (code_lo signed b) - 1 <= z <= IZR (code_hi signed b) + 1 ->
  Rabs (IZR (rnd z) - z) <= / 2 + eta.

(** A scale choice that never clamps: with the scaled input in the code range, the clamp into
    the b-bit range leaves the code unchanged at every point of the dither grid. *)
Theorem bcode_eq_of_in_range y :
  in_code_range signed b N eta y ->
  forall i, (i < N)%nat -> bcode signed b rnd (y + grid_u N i) = rnd (y + grid_u N i).
Proof.
  intros [Hlo Hhi] i Hi. destruct (grid_u_bounds N i HN Hi) as [Hu1 Hu2].
  assert (HNr : 0 < INR N) by (apply lt_0_INR; lia).
  assert (Hh : 0 < / (2 * INR N)) by (apply Rinv_0_lt_compat; lra).
  unfold bcode. apply (clamp_eq_of_close _ _ _ eta (y + grid_u N i)); [apply R_close; lra|lra|lra].
Qed.

Lemma bcode_close y :
  in_code_range signed b N eta y ->
  forall i, (i < N)%nat -> Rabs (grid_err N (bcode signed b rnd) y i) <= / 2 + eta.
Proof.
  intros Hy i Hi. unfold grid_err. rewrite (bcode_eq_of_in_range y Hy i Hi).
  assert (HNr : 0 < INR N) by (apply lt_0_INR; lia).
  assert (Hh : 0 < / (2 * INR N)) by (apply Rinv_0_lt_compat; lra).
  destruct Hy as [Hlo Hhi]. destruct (grid_u_bounds N i HN Hi) as [Hu1 Hu2]. apply R_close; lra.
Qed.

(** T6g for b-bit codes: the mean grid error of the clamped code is within 1/(2N) + eta. *)
Theorem abs_bcode_err_mean_le y :
  in_code_range signed b N eta y ->
  Rabs (avg N (grid_err N (bcode signed b rnd) y)) <= / (2 * INR N) + eta.
Proof.
  intros Hy. apply (abs_grid_err_mean_le N HN _ (bcode_mono signed b rnd R_mono) eta y eta_lt).
  apply bcode_close. exact Hy.
Qed.

(** T6h for b-bit codes: the centred grid error of the clamped code is sub-Gaussian with proxy
    (1 - 1/N^2)/12 (N = 2^K). *)
Theorem bcode_err_mgf_le K y a :
  N = (2 ^ K)%nat -> in_code_range signed b N eta y ->
  avg N (fun i => exp (a * (grid_err N (bcode signed b rnd) y i - avg N (grid_err N (bcode signed b rnd) y))))
  <= exp (a ^ 2 * (1 - / INR N ^ 2) / 24).
Proof.
  intros HNK Hy.
  apply (grid_err_mgf_le N HN _ (bcode_mono signed b rnd R_mono) eta y eta_lt (bcode_close y Hy) K HNK).
Qed.

(** Clamping breaks the law: a scaled input a whole step above the range has every grid error
    below -(1/2 + 1/(2N)), so its mean is too (far outside T6g's 1/(2N) + eta): a code must
    refuse such inputs (or certify deterministically), never clamp them silently. *)
Theorem bcode_err_mean_le_of_above_range y :
  (1 <= b)%nat -> IZR (code_hi signed b) + 1 <= y ->
  avg N (grid_err N (bcode signed b rnd) y) <= - (/ 2 + / (2 * INR N)).
Proof.
  intros Hb Hy. rewrite <- (avg_const N HN (- (/ 2 + / (2 * INR N)))).
  apply (avg_le N HN). intros i Hi. destruct (grid_u_bounds N i HN Hi) as [Hu1 _].
  destruct (code_range_fits_b_bits signed b Hb) as [Hlh _].
  assert (Hc : (bcode signed b rnd (y + grid_u N i) <= code_hi signed b)%Z) by (unfold bcode; lia).
  apply IZR_le in Hc. unfold grid_err. lra.
Qed.

End Code.

Section Read.
Variables (N K : nat) (signed : bool) (b : nat).
Hypothesis HNK : N = (2 ^ K)%nat.
Variable rnd : R -> Z.
Hypothesis R_mono : forall a c, a <= c -> (rnd a <= rnd c)%Z.
Variable eta : R.
Hypothesis eta_nonneg : 0 <= eta.
Hypothesis eta_lt : 2 * eta < / INR N.
Hypothesis R_close : forall z, IZR (code_lo signed b) - 1 <= z <= IZR (code_hi signed b) + 1 ->
  Rabs (IZR (rnd z) - z) <= / 2 + eta.
Variables (M : nat) (ys : nat -> R).
Hypothesis ys_in_range : forall k, (k < M)%nat -> in_code_range signed b N eta (ys k).

Lemma bcode_close_all :
  forall k i, (k < M)%nat -> (i < N)%nat -> Rabs (grid_err N (bcode signed b rnd) (ys k) i) <= / 2 + eta.
Proof.
  intros k i Hk Hi. apply (bcode_close N signed b (HN N K HNK) rnd eta eta_nonneg R_close (ys k) (ys_in_range k Hk) i Hi).
Qed.

(** T6i for b-bit codes: one token's logit error, within rho of a fixed linear form in the
    clamped b-bit dithered coordinates whose scaled inputs lie in the code range, exceeds
    bias + rho + sigma sqrt(2 ln(2n/d)) with probability at most d/n. *)
Theorem token_failure_le_of_bcode (c : nat -> R) (Xr : (nat -> nat) -> R) (rho : R) (n : nat) (d : R) :
  (0 < n)%nat -> 0 < d -> d <= 2 * INR n ->
  (forall w, Rabs (Xr w - lin_err N (bcode signed b rnd) ys M c w) <= rho) ->
  Eu N M (viol Xr (bias_bound N eta M c + rho + sqrt (proxy M c) * sqrt (2 * ln (2 * INR n / d))))
  <= d / INR n.
Proof.
  apply (token_failure_le N K HNK _ (bcode_mono signed b rnd R_mono) eta eta_nonneg eta_lt M ys bcode_close_all).
Qed.

(** T6j for b-bit codes: the request-level failure bound, any number of steps, clamped b-bit
    codes with every scaled input in the code range. *)
Theorem request_failure_le_of_bcode (L H T : nat) (delta_req : R) (n : nat -> nat)
  (c : nat -> nat -> nat -> nat -> nat -> R)
  (Xr : nat -> nat -> nat -> nat -> (nat -> nat) -> R)
  (rho : nat -> nat -> nat -> nat -> R) :
  (0 < L)%nat -> (0 < H)%nat -> 0 < delta_req <= 1 -> (forall t, (0 < n t)%nat) ->
  (forall l h t j w, Rabs (Xr l h t j w - lin_err N (bcode signed b rnd) ys M (c l h t j) w) <= rho l h t j) ->
  Eu N M (any_ind T (fun i => any_ind L (fun l => any_ind H (fun h =>
    any_ind (n (S i)) (fun j =>
      viol (Xr l h (S i) j)
        (bias_bound N eta M (c l h (S i) j) + rho l h (S i) j
         + sqrt (proxy M (c l h (S i) j))
           * sqrt (2 * ln (2 * INR (n (S i))
                    / (delta_req / (INR L * INR H * INR (S i) * (INR (S i) + 1)))))))))))
  <= delta_req.
Proof.
  apply (request_failure_le_of_grid N K HNK _ (bcode_mono signed b rnd R_mono) eta eta_nonneg eta_lt M ys bcode_close_all).
Qed.

End Read.

(** * The code's own rounding at 4 and 2 bits

    fast/core/quant.py dither_codes computes m = round_half_even(fl32(y + u)). Within a step of a code
    range inside [-8, 8] (int4_dither [-7, 7], kivi2_dither [0, 3]) that rounding is monotone and
    within 1/2 + 2^-21 + 2^-150 of its argument, so DitherCode's hypotheses hold for it with no
    appeal to A6 (the rest of the codecs' fp32 error, rho, stays A6). *)

Definition code_round32 (choice tie : Z -> bool) (z : R) : Z := Znearest tie (rn32 choice z).

Definition eta_small : R := 8 * u32 + eta32.

Lemma code_round32_mono choice tie a c : a <= c -> (code_round32 choice tie a <= code_round32 choice tie c)%Z.
Proof.
  intros H. unfold code_round32. apply Zrnd_le; [apply valid_rnd_N|].
  unfold rn32, rn_fmt. apply round_le; [apply FLT_exp_valid; exact prec32_gt_0|apply valid_rnd_N|exact H].
Qed.

Lemma eta_small_bounds : 0 <= eta_small /\ 2 * eta_small < / INR (2 ^ 16).
Proof.
  unfold eta_small, u32, eta32. rewrite pow_INR. simpl INR.
  split; [|apply Rminus_gt_0_lt; simpl; field_simplify; lra].
  assert (0 < / 2 ^ 24) by (apply Rinv_0_lt_compat, pow_lt; lra).
  assert (0 < / 2 ^ 150) by (apply Rinv_0_lt_compat, pow_lt; lra). lra.
Qed.

(** The code's rounding is close within a step of any code range inside [-7, 7]. *)
Theorem code_round32_close choice tie signed b z :
  (-7 <= code_lo signed b)%Z -> (code_hi signed b <= 7)%Z ->
  IZR (code_lo signed b) - 1 <= z <= IZR (code_hi signed b) + 1 ->
  Rabs (IZR (code_round32 choice tie z) - z) <= / 2 + eta_small.
Proof.
  intros Hlo Hhi Hz. apply IZR_le in Hlo. apply IZR_le in Hhi.
  assert (Hz8 : Rabs z <= 8) by (apply Rabs_le; lra).
  pose proof (abs_rn_sub_le (-149) 24 prec32_gt_0 choice z) as Hr.
  rewrite <- u32_eq, <- eta32_eq in Hr. fold (rn32 choice z) in Hr.
  pose proof (Znearest_half tie (rn32 choice z)) as Hn.
  assert (Hu : 0 < u32) by apply u32_small.
  assert (Hux : u32 * Rabs z <= u32 * 8) by (apply Rmult_le_compat_l; lra).
  replace (IZR (code_round32 choice tie z) - z)
    with (- (rn32 choice z - IZR (Znearest tie (rn32 choice z))) + (rn32 choice z - z)) by (unfold code_round32; ring).
  eapply Rle_trans; [apply Rabs_triang|]. rewrite Rabs_Ropp. unfold eta_small. lra.
Qed.

Lemma int4_kivi2_windows :
  ((-7 <= code_lo true 4)%Z /\ (code_hi true 4 <= 7)%Z) /\ ((-7 <= code_lo false 2)%Z /\ (code_hi false 2 <= 7)%Z).
Proof. vm_compute. repeat split; discriminate. Qed.

(** T6i at 4 and 2 bits with the code's own rounding: for int4_dither (signed, b = 4) and kivi2_dither
    (unsigned, b = 2) codes m = round(fl32(y + u)) on the 16-bit grid, with every scaled input in its code
    range, one token's logit error exceeds bias + rho + sigma sqrt(2 ln(2n/d)), the bias with
    eta = 2^-21 + 2^-150 (the code's radius uses 2^-18), with probability at most d/n. *)
Theorem token_failure_le_of_code_round32 choice tie signed b (M : nat) (ys : nat -> R)
  (c : nat -> R) (Xr : (nat -> nat) -> R) (rho : R) (n : nat) (d : R) :
  (signed = true /\ b = 4%nat) \/ (signed = false /\ b = 2%nat) ->
  (forall k, (k < M)%nat -> in_code_range signed b (2 ^ 16) eta_small (ys k)) ->
  (0 < n)%nat -> 0 < d -> d <= 2 * INR n ->
  (forall w, Rabs (Xr w - lin_err (2 ^ 16) (bcode signed b (code_round32 choice tie)) ys M c w) <= rho) ->
  Eu (2 ^ 16) M (viol Xr (bias_bound (2 ^ 16) eta_small M c + rho + sqrt (proxy M c) * sqrt (2 * ln (2 * INR n / d))))
  <= d / INR n.
Proof.
  intros Hsb Hys. destruct eta_small_bounds as [He0 He1].
  assert (Hw : (-7 <= code_lo signed b)%Z /\ (code_hi signed b <= 7)%Z).
  { destruct int4_kivi2_windows as [H4 H2]. destruct Hsb as [[-> ->]|[-> ->]]; assumption. }
  apply (token_failure_le_of_bcode (2 ^ 16) 16 signed b eq_refl (code_round32 choice tie)
           (code_round32_mono choice tie) eta_small He0 He1
           (fun z Hz => code_round32_close choice tie signed b z (proj1 Hw) (proj2 Hw) Hz) M ys Hys).
Qed.
