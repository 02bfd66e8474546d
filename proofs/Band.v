(** T4: band Cauchy-Schwarz and the per-token witness bound on the logit error.
    Bands are ANY partition of the coordinates 0..D-1, given by an assignment
    [band : nat -> nat] with [band i < NB] for every [i < D]. *)
From KVCert Require Import Prelim.
From Coq Require Import Reals Lra Lia.
Open Scope R_scope.

Definition inner (D : nat) (q r : nat -> R) : R := sum D (fun i => q i * r i).

(** Euclidean norm of the part of [x] that lies in band [b]. *)
Definition band_norm (D : nat) (band : nat -> nat) (x : nat -> R) (b : nat) : R :=
  sqrt (sum D (fun i => if Nat.eqb (band i) b then x i ^ 2 else 0)).

(** * Splitting a finite sum over a partition *)

Lemma sum_indicator NB m c :
  (m < NB)%nat -> sum NB (fun b => if Nat.eqb m b then c else 0) = c.
Proof.
  induction NB as [|NB IH]; intros Hm; [lia|]. simpl.
  destruct (Nat.eqb_spec m NB) as [E|E].
  - rewrite (sum_ext _ _ (fun _ => 0)), sum_const; [lra|].
    intros b Hb. destruct (Nat.eqb_spec m b); [lia|reflexivity].
  - rewrite IH by lia. lra.
Qed.

(** A sum over 0..D-1 is the sum over the bands of the band-restricted sums
    (indices outside every band must carry a zero term). *)
Lemma sum_eq_sum_bands D NB band f :
  (forall i, (i < D)%nat -> (band i < NB)%nat \/ f i = 0) ->
  sum D f = sum NB (fun b => sum D (fun i => if Nat.eqb (band i) b then f i else 0)).
Proof.
  intros H. rewrite sum_swap. apply sum_ext. intros i Hi.
  destruct (H i Hi) as [Hb|Hz].
  - symmetry. apply sum_indicator. exact Hb.
  - rewrite Hz, (sum_ext _ _ (fun _ => 0)), sum_const; [lra|].
    intros b _. destruct (Nat.eqb (band i) b); reflexivity.
Qed.

(** * Band norms *)

Lemma band_norm_nonneg D band x b : 0 <= band_norm D band x b.
Proof. apply sqrt_pos. Qed.

Lemma restrict_sq D band x b :
  sum D (fun i => (if Nat.eqb (band i) b then x i else 0) ^ 2)
  = sum D (fun i => if Nat.eqb (band i) b then x i ^ 2 else 0).
Proof. apply sum_ext. intros i _. destruct (Nat.eqb (band i) b); ring. Qed.

Lemma sum_band_norm_sq D NB band x :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  sum NB (fun b => band_norm D band x b ^ 2) = sum D (fun i => x i ^ 2).
Proof.
  intros Hband. rewrite (sum_eq_sum_bands D NB band (fun i => x i ^ 2))
    by (intros; left; auto).
  apply sum_ext. intros b _. unfold band_norm. apply pow2_sqrt.
  apply sum_nonneg. intros i _. destruct (Nat.eqb (band i) b); [apply pow2_ge_0|lra].
Qed.

(** ** T4a *)

(** The logit error against ANY key error is bounded by per-band norm products, so a
    per-band witness of the key error suffices to certify it. *)
Theorem abs_inner_le_sum_band_norms D NB band q r :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  Rabs (inner D q r) <= sum NB (fun b => band_norm D band q b * band_norm D band r b).
Proof.
  intros Hband. unfold inner.
  rewrite (sum_eq_sum_bands D NB band (fun i => q i * r i)) by (intros; left; auto).
  eapply Rle_trans; [apply sum_abs_le|]. apply sum_le. intros b _.
  rewrite (sum_ext _ _ (fun i => (if Nat.eqb (band i) b then q i else 0)
                                 * (if Nat.eqb (band i) b then r i else 0)))
    by (intros; destruct (Nat.eqb (band _) b); ring).
  eapply Rle_trans; [apply cauchy_schwarz_abs|].
  unfold norm, band_norm. rewrite !restrict_sq. lra.
Qed.

(** ** T4b *)

(** The band bound is never looser than the plain Cauchy-Schwarz bound
    [norm q * norm r], whatever the partition. *)
Theorem sum_band_norms_le_norm_mul_norm D NB band q r :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  sum NB (fun b => band_norm D band q b * band_norm D band r b) <= norm D q * norm D r.
Proof.
  intros Hband.
  eapply Rle_trans; [apply cauchy_schwarz|].
  unfold norm. rewrite !sum_band_norm_sq by exact Hband. lra.
Qed.

(** ** T4c *)

(** A stored witness [rho b >= band_norm r b] certifies the scaled logit error
    [s <q, r>] for EVERY query q, including one chosen after seeing the cache. *)
Theorem abs_logit_error_le_of_witness D NB band s q r rho :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  0 <= s ->
  (forall b, (b < NB)%nat -> band_norm D band r b <= rho b) ->
  Rabs (s * inner D q r) <= s * sum NB (fun b => band_norm D band q b * rho b).
Proof.
  intros Hband Hs Hrho.
  rewrite Rabs_mult, (Rabs_right s) by lra.
  apply Rmult_le_compat_l; [exact Hs|].
  eapply Rle_trans; [apply abs_inner_le_sum_band_norms; exact Hband|].
  apply sum_le. intros b Hb.
  apply Rmult_le_compat_l; [apply band_norm_nonneg|]. apply Hrho. exact Hb.
Qed.

(** The same bound written for an exact key [k] and its stored copy [kt]. *)
Lemma abs_logit_sub_le_of_witness D NB band s q k kt rho :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  0 <= s ->
  (forall b, (b < NB)%nat -> band_norm D band (fun i => k i - kt i) b <= rho b) ->
  Rabs (s * inner D q k - s * inner D q kt)
  <= s * sum NB (fun b => band_norm D band q b * rho b).
Proof.
  intros Hband Hs Hrho.
  replace (s * inner D q k - s * inner D q kt) with (s * inner D q (fun i => k i - kt i)).
  - apply abs_logit_error_le_of_witness; assumption.
  - unfold inner. rewrite <- Rmult_minus_distr_l, <- sum_sub. f_equal.
    apply sum_ext. intros. ring.
Qed.
