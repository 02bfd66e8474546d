(** The query-subspace witness: a key residual is split into its coordinates [a]
    along the rows of a matrix [U] (m rows, D columns, [U k i] = row k, column i)
    and a remainder bounded per band. Nothing requires [U] to be orthonormal, nor
    [a] (for the key) and [p] (for the query) to be projections: every identity
    below is exact for ANY [U], [a] and [p]. *)
From KVCert Require Import Prelim Band.
From Coq Require Import Reals Lra Lia.
Open Scope R_scope.

(** [U x], an m-vector. *)
Definition matvec (D : nat) (U : nat -> nat -> R) (x : nat -> R) : nat -> R :=
  fun k => sum D (fun i => U k i * x i).

(** [U^T a], a D-vector. *)
Definition matTvec (m : nat) (U : nat -> nat -> R) (a : nat -> R) : nat -> R :=
  fun i => sum m (fun k => U k i * a k).

(** * Algebra of [inner], [matvec] and [matTvec] *)

Lemma inner_sym D x y : inner D x y = inner D y x.
Proof. unfold inner. apply sum_ext. intros. ring. Qed.

Lemma inner_add_r D x y z :
  inner D x (fun i => y i + z i) = inner D x y + inner D x z.
Proof.
  unfold inner. rewrite <- sum_add. apply sum_ext. intros. ring.
Qed.

Lemma inner_sub_r D x y z :
  inner D x (fun i => y i - z i) = inner D x y - inner D x z.
Proof.
  unfold inner. rewrite <- sum_sub. apply sum_ext. intros. ring.
Qed.

Lemma inner_sub_l D x y z :
  inner D (fun i => x i - y i) z = inner D x z - inner D y z.
Proof.
  unfold inner. rewrite <- sum_sub. apply sum_ext. intros. ring.
Qed.

(** [U^T] is the adjoint of [U]: [<x, U^T a> = <U x, a>]. *)
Lemma inner_matTvec D m U x a :
  inner D x (matTvec m U a) = inner m (matvec D U x) a.
Proof.
  unfold inner, matTvec, matvec.
  rewrite (sum_ext D _ (fun i => sum m (fun k => x i * (U k i * a k))))
    by (intros; rewrite <- sum_scal_l; reflexivity).
  rewrite sum_swap. apply sum_ext. intros k _.
  rewrite <- sum_scal_r. apply sum_ext. intros. ring.
Qed.

Lemma inner_matTvec_l D m U p y :
  inner D (matTvec m U p) y = inner m p (matvec D U y).
Proof.
  rewrite inner_sym, inner_matTvec. apply inner_sym.
Qed.

(** The exact decomposition of the logit shift: with [r' = r - U^T a] and
    [q' = q - U^T p], [<q, r> - <U q, a> = <p, U r'> + <q', r'>]. *)
Lemma inner_sub_center_eq D m U q r a p :
  inner D q r - inner m (matvec D U q) a
  = inner m p (matvec D U (fun i => r i - matTvec m U a i))
    + inner D (fun i => q i - matTvec m U p i) (fun i => r i - matTvec m U a i).
Proof.
  rewrite <- inner_matTvec_l, inner_sub_l, <- inner_matTvec, <- inner_sub_r.
  rewrite inner_sub_r, inner_sub_r. ring.
Qed.

(** * The subspace witness bound *)

(** The logit shift away from the subspace estimate [<U q, a>] is bounded by a
    subspace term [|p| |U r'|] plus a band term on the residuals, for ANY
    coordinates [a], [p] and ANY matrix [U], so a stored witness of the residual
    certifies it whatever the query. *)
Theorem abs_inner_sub_center_le D NB m band U q r a p :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  Rabs (inner D q r - inner m (matvec D U q) a)
  <= norm m p * norm m (matvec D U (fun i => r i - matTvec m U a i))
     + sum NB (fun b => band_norm D band (fun i => q i - matTvec m U p i) b
                        * band_norm D band (fun i => r i - matTvec m U a i) b).
Proof.
  intros Hband. rewrite (inner_sub_center_eq D m U q r a p).
  eapply Rle_trans; [apply Rabs_triang|]. apply Rplus_le_compat.
  - unfold inner. apply cauchy_schwarz_abs.
  - apply abs_inner_le_sum_band_norms. exact Hband.
Qed.

(** The stored, rounded-up quantities (center error [em], coordinate norm [pn],
    subspace residual [tau], query band norms [qn], residual witness [sigma])
    certify the scaled logit shift away from the stored center [mu]. *)
Theorem abs_logit_sub_center_le_of_subspace_witness
    D NB m band U q r a p s mu em pn tau qn sigma :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  0 <= s ->
  Rabs (inner m (matvec D U q) a - mu) <= em ->
  norm m p <= pn ->
  norm m (matvec D U (fun i => r i - matTvec m U a i)) <= tau ->
  (forall b, (b < NB)%nat -> band_norm D band (fun i => q i - matTvec m U p i) b <= qn b) ->
  (forall b, (b < NB)%nat -> band_norm D band (fun i => r i - matTvec m U a i) b <= sigma b) ->
  Rabs (s * inner D q r - s * mu) <= s * (em + pn * tau + sum NB (fun b => qn b * sigma b)).
Proof.
  intros Hband Hs Hem Hpn Htau Hqn Hsigma.
  rewrite <- Rmult_minus_distr_l, Rabs_mult, (Rabs_right s) by lra.
  apply Rmult_le_compat_l; [exact Hs|].
  replace (inner D q r - mu)
    with ((inner D q r - inner m (matvec D U q) a) + (inner m (matvec D U q) a - mu))
    by ring.
  eapply Rle_trans; [apply Rabs_triang|].
  pose proof (abs_inner_sub_center_le D NB m band U q r a p Hband) as Hc.
  assert (Hsub : norm m p * norm m (matvec D U (fun i => r i - matTvec m U a i))
                 <= pn * tau).
  { apply Rmult_le_compat; [apply norm_nonneg|apply norm_nonneg|exact Hpn|exact Htau]. }
  assert (Hbands :
    sum NB (fun b => band_norm D band (fun i => q i - matTvec m U p i) b
                     * band_norm D band (fun i => r i - matTvec m U a i) b)
    <= sum NB (fun b => qn b * sigma b)).
  { apply sum_le. intros b Hb.
    apply Rmult_le_compat; [apply band_norm_nonneg|apply band_norm_nonneg|
                            apply Hqn; exact Hb|apply Hsigma; exact Hb]. }
  lra.
Qed.

(** The same certificate written for an exact key [k] and its stored copy [kt]:
    the scaled logit shift lies in an explicit interval around [s * mu]. *)
Corollary logit_shift_in_interval_of_subspace_witness
    D NB m band U q k kt a p s mu em pn tau qn sigma :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  0 <= s ->
  Rabs (inner m (matvec D U q) a - mu) <= em ->
  norm m p <= pn ->
  norm m (matvec D U (fun i => (k i - kt i) - matTvec m U a i)) <= tau ->
  (forall b, (b < NB)%nat -> band_norm D band (fun i => q i - matTvec m U p i) b <= qn b) ->
  (forall b, (b < NB)%nat ->
     band_norm D band (fun i => (k i - kt i) - matTvec m U a i) b <= sigma b) ->
  s * mu - s * (em + pn * tau + sum NB (fun b => qn b * sigma b))
  <= s * inner D q k - s * inner D q kt
  <= s * mu + s * (em + pn * tau + sum NB (fun b => qn b * sigma b)).
Proof.
  intros Hband Hs Hem Hpn Htau Hqn Hsigma.
  pose proof (abs_logit_sub_center_le_of_subspace_witness
                D NB m band U q (fun i => k i - kt i) a p s mu em pn tau qn sigma
                Hband Hs Hem Hpn Htau Hqn Hsigma) as H.
  rewrite inner_sub_r in H.
  unfold Rabs in H. destruct (Rcase_abs _) in H; split; lra.
Qed.
