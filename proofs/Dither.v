(** T6: the probabilistic tier (subtractive INT8 dither). The uniform dither is
    sub-Gaussian with variance proxy 1/12 (T6a, T6b); Chernoff's bound over an abstract
    expectation turns this into a tail bound (T6c); the per-read radius spends exactly its
    local budget (T6d); the any-time schedule keeps a request within delta_req (T6e).
    Caveat: T6c-T6e assume the query does not depend on the dither (non-adaptive queries);
    autoregressive decoding feeds outputs back, and the deterministic tier has no such
    caveat. *)
From Coq Require Import Reals Lra Lia.
From Coquelicot Require Import Coquelicot.
From KVCert Require Import Prelim.
Open Scope R_scope.

(** * T6a *)

(** Partial sums of the exponential series. *)
Definition exp_partial (x : R) (N : nat) : R :=
  sum_f_R0 (fun i => / INR (fact i) * x ^ i) N.

Lemma exp_partial_cv x : Un_cv (exp_partial x) (exp x).
Proof.
  unfold exp_partial, exp. destruct (exist_exp x) as [l Hl]. simpl. exact Hl.
Qed.

Lemma exp_partial_le x N : 0 <= x -> exp_partial x N <= exp x.
Proof.
  intros Hx. apply sum_incr; [apply exp_partial_cv|].
  intros i. apply Rmult_le_pos; [|apply pow_le; exact Hx].
  left. apply Rinv_0_lt_compat, lt_0_INR, lt_O_fact.
Qed.

Lemma cv_odd_subseq u l : Un_cv u l -> Un_cv (fun N => u (2 * N + 1)%nat) l.
Proof.
  intros H eps Heps. destruct (H eps Heps) as [N HN].
  exists N. intros n Hn. apply HN. lia.
Qed.

Lemma cv_const c : Un_cv (fun _ => c) c.
Proof.
  intros eps Heps. exists O. intros n _. unfold R_dist. rewrite Rminus_eq_0, Rabs_R0. lra.
Qed.

(** (2k+1)! >= 6^k k!: the termwise comparison of the two series. *)
Lemma fact_odd_ge k : (6 ^ k * fact k <= fact (2 * k + 1))%nat.
Proof.
  induction k as [|k IH]; [simpl; lia|].
  replace (2 * S k + 1)%nat with (S (S (2 * k + 1))) by lia.
  change (fact (S (S (2 * k + 1)))) with (S (S (2 * k + 1)) * (S (2 * k + 1) * fact (2 * k + 1)))%nat.
  change (fact (S k)) with (S k * fact k)%nat. rewrite Nat.pow_succ_r'. nia.
Qed.

Lemma pow_opp_even x m : (- x) ^ (2 * m) = x ^ (2 * m).
Proof. rewrite !pow_mult. f_equal. ring. Qed.

Lemma pow_opp_odd x m : (- x) ^ (2 * m + 1) = - x ^ (2 * m + 1).
Proof. rewrite !pow_add, pow_opp_even. ring. Qed.

Lemma exp_partial_odd x N :
  exp_partial x (2 * N + 1) - exp_partial (- x) (2 * N + 1)
  = 2 * sum_f_R0 (fun k => / INR (fact (2 * k + 1)) * x ^ (2 * k + 1)) N.
Proof.
  unfold exp_partial. induction N as [|N IH]; [simpl; field|].
  replace (2 * S N + 1)%nat with (S (S (2 * N + 1))) by lia.
  rewrite !tech5.
  replace (S (2 * N + 1)) with (2 * S N)%nat by lia.
  replace (S (2 * S N)) with (2 * S N + 1)%nat by lia.
  rewrite pow_opp_even, pow_opp_odd.
  transitivity (sum_f_R0 (fun i => / INR (fact i) * x ^ i) (2 * N + 1)
    - sum_f_R0 (fun i => / INR (fact i) * (- x) ^ i) (2 * N + 1)
    + 2 * (/ INR (fact (2 * S N + 1)) * x ^ (2 * S N + 1))); [ring|].
  rewrite IH. ring.
Qed.

Lemma odd_term_le x k : 0 <= x ->
  / INR (fact (2 * k + 1)) * x ^ (2 * k + 1) <= / INR (fact k) * (x ^ 2 / 6) ^ k * x.
Proof.
  intros Hx.
  assert (Hf : 0 < INR (fact k)) by apply lt_0_INR, lt_O_fact.
  assert (H6 : 0 < 6 ^ k) by (apply pow_lt; lra).
  assert (Hle : 6 ^ k * INR (fact k) <= INR (fact (2 * k + 1))).
  { replace 6 with (INR 6) by (simpl; ring). rewrite <- pow_INR, <- mult_INR.
    apply le_INR, fact_odd_ge. }
  replace (/ INR (fact k) * (x ^ 2 / 6) ^ k * x)
    with (/ (6 ^ k * INR (fact k)) * x ^ (2 * k + 1)).
  - apply Rmult_le_compat_r; [apply pow_le; exact Hx|].
    apply Rinv_le_contravar; [apply Rmult_lt_0_compat; lra|exact Hle].
  - unfold Rdiv. rewrite Rpow_mult_distr, pow_inv, pow_add, pow_mult. field. lra.
Qed.

(** Sub-Gaussian comparison for sinh: for x >= 0, sinh x <= x exp(x^2/6), which makes the
    uniform dither sub-Gaussian with variance proxy equal to its variance. *)
Theorem sinh_le_mul_exp_sq_div_six x : 0 <= x -> sinh x <= x * exp (x ^ 2 / 6).
Proof.
  intros Hx.
  assert (Hcv : Un_cv (fun N => exp_partial x (2 * N + 1) - exp_partial (- x) (2 * N + 1))
                      (exp x - exp (- x))).
  { apply CV_minus; apply cv_odd_subseq, exp_partial_cv. }
  assert (Hb : exp x - exp (- x) <= 2 * (x * exp (x ^ 2 / 6))).
  { eapply Rle_cv_lim; [|exact Hcv|apply (cv_const (2 * (x * exp (x ^ 2 / 6))))].
    intros N. cbv beta. rewrite exp_partial_odd. apply Rmult_le_compat_l; [lra|].
    apply Rle_trans with (sum_f_R0 (fun k => / INR (fact k) * (x ^ 2 / 6) ^ k * x) N).
    - apply sum_Rle. intros k _. apply odd_term_le. exact Hx.
    - rewrite <- scal_sum. apply Rmult_le_compat_l; [exact Hx|].
      apply exp_partial_le. apply Rmult_le_pos; [apply pow_le; exact Hx|lra]. }
  unfold sinh. lra.
Qed.

(** * T6b *)

(** The moment generating function of the continuous uniform dither on [-1/2, 1/2] in closed
    form, sinh(y/2)/(y/2), for y <> 0. *)
Theorem uniform_mgf_eq y :
  y <> 0 -> RInt (fun u => exp (y * u)) (-1/2) (1/2) = sinh (y / 2) / (y / 2).
Proof.
  intros Hy.
  assert (H : is_RInt (fun u => exp (y * u)) (-1/2) (1/2)
                (minus (exp (y * (1/2)) / y) (exp (y * (-1/2)) / y))).
  { apply (is_RInt_derive (fun u => exp (y * u) / y)).
    - intros u _. auto_derive; [exact I|]. field. exact Hy.
    - intros u _. apply (ex_derive_continuous (fun u => exp (y * u))). auto_derive. exact I. }
  rewrite (is_RInt_unique _ _ _ _ H).
  unfold minus, plus, opp. simpl. unfold sinh.
  replace (y * (1/2)) with (y / 2) by field.
  replace (y * (-1/2)) with (- (y / 2)) by field.
  field. exact Hy.
Qed.

Lemma uniform_mgf_eq_zero : RInt (fun u => exp (0 * u)) (-1/2) (1/2) = 1.
Proof.
  rewrite (RInt_ext _ (fun _ => 1)) by (intros; rewrite Rmult_0_l; apply exp_0).
  rewrite RInt_const. unfold scal. simpl. unfold mult. simpl. field.
Qed.

Lemma sinh_div_le x : 0 < x -> sinh x / x <= exp (x ^ 2 / 6).
Proof.
  intros Hx. unfold Rdiv at 1. apply (Rmult_le_reg_r x); [exact Hx|].
  rewrite Rmult_assoc, Rinv_l, Rmult_1_r by lra. rewrite Rmult_comm.
  apply sinh_le_mul_exp_sq_div_six. lra.
Qed.

(** The uniform dither on [-1/2, 1/2] has moment generating function at most
    exp(y^2/24), i.e. it is sub-Gaussian with variance proxy 1/12, its own variance. *)
Theorem uniform_mgf_le_exp y : RInt (fun u => exp (y * u)) (-1/2) (1/2) <= exp (y ^ 2 / 24).
Proof.
  destruct (Req_dec y 0) as [H0|H0].
  - subst y. rewrite uniform_mgf_eq_zero. replace (0 ^ 2 / 24) with 0 by field.
    rewrite exp_0. lra.
  - rewrite uniform_mgf_eq by exact H0.
    destruct (Rlt_or_le 0 y) as [Hp|Hn].
    + replace (y ^ 2 / 24) with ((y / 2) ^ 2 / 6) by field.
      apply sinh_div_le. lra.
    + replace (y ^ 2 / 24) with ((- y / 2) ^ 2 / 6) by field.
      replace (sinh (y / 2) / (y / 2)) with (sinh (- y / 2) / (- y / 2)).
      * apply sinh_div_le. lra.
      * unfold sinh. replace (- (- y / 2)) with (y / 2) by field.
        replace (- (y / 2)) with (- y / 2) by field. field. exact H0.
Qed.

(** The dither error w U, U uniform on [-1/2, 1/2], satisfies the MGF hypothesis of
    [tail_le_of_mgf_le] with v = w^2/12. *)
Lemma scaled_uniform_mgf_le_exp (w lambda : R) :
  RInt (fun u => exp (lambda * (w * u))) (-1/2) (1/2) <= exp (lambda ^ 2 * (w ^ 2 / 12) / 2).
Proof.
  rewrite (RInt_ext _ (fun u => exp ((lambda * w) * u))) by (intros; f_equal; ring).
  replace (lambda ^ 2 * (w ^ 2 / 12) / 2) with ((lambda * w) ^ 2 / 24) by field.
  apply uniform_mgf_le_exp.
Qed.

(** * T6c *)

(** Finite products over indices 0..n-1 (the companion of [sum]). *)
Fixpoint rprod (n : nat) (f : nat -> R) : R :=
  match n with
  | O => 1
  | S m => rprod m f * f m
  end.

Lemma rprod_le n f g :
  (forall i, (i < n)%nat -> 0 <= f i <= g i) -> rprod n f <= rprod n g.
Proof.
  induction n as [|n IH]; intros H; simpl; [lra|].
  assert (0 <= rprod n f).
  { clear IH. induction n as [|n IHn]; simpl; [lra|].
    apply Rmult_le_pos; [apply IHn; intros; apply H; lia|apply H; lia]. }
  assert (Hn : 0 <= f n <= g n) by (apply H; lia).
  apply Rmult_le_compat; [lra|lra| |lra]. apply IH. intros; apply H; lia.
Qed.

Lemma exp_sum_eq_rprod n f : exp (sum n f) = rprod n (fun i => exp (f i)).
Proof.
  induction n as [|n IH]; simpl; [apply exp_0|]. rewrite exp_plus, IH. reflexivity.
Qed.

Section Chernoff.

(** An abstract expectation: any operator on real functions over a sample space that is
    monotone, additive and commutes with constant factors. No measure theory is needed;
    E is total here, a modelling simplification (the functions used are bounded or
    exponentials of the dither, integrable in the intended model). These hypotheses become
    premises of the theorems below, not axioms. *)
Variable Omega : Type.
Variable E : (Omega -> R) -> R.
Hypothesis E_mono : forall f g, (forall w, f w <= g w) -> E f <= E g.
Hypothesis E_add : forall f g, E (fun w => f w + g w) = E f + E g.
Hypothesis E_scal : forall c f, E (fun w => c * f w) = c * E f.

(** Indicator of the event [x <= Y]; its expectation is P(Y >= x). *)
Definition ind_ge (Y : Omega -> R) (x : R) (w : Omega) : R :=
  if Rle_dec x (Y w) then 1 else 0.

Lemma E_ext f g : (forall w, f w = g w) -> E f = E g.
Proof.
  intros H. apply Rle_antisym; apply E_mono; intros w; rewrite H; lra.
Qed.

Lemma E_nonneg f : (forall w, 0 <= f w) -> 0 <= E f.
Proof.
  intros H. replace 0 with (E (fun w => 0 * f w)).
  - apply E_mono. intros w. rewrite Rmult_0_l. apply H.
  - rewrite E_scal. lra.
Qed.

Lemma ind_ge_le_exp (Y : Omega -> R) x lambda w :
  0 <= lambda -> ind_ge Y x w <= exp (lambda * (Y w - x)).
Proof.
  intros Hl. unfold ind_ge. destruct (Rle_dec x (Y w)) as [H|H].
  - assert (0 <= lambda * (Y w - x)) by (apply Rmult_le_pos; lra).
    pose proof (exp_ineq1_le (lambda * (Y w - x))). lra.
  - left. apply exp_pos.
Qed.

(** One-sided Chernoff bound. *)
Lemma tail_ge_le_of_mgf_le (Y : Omega -> R) (v x : R) :
  0 < v -> 0 <= x ->
  (forall lambda, E (fun w => exp (lambda * Y w)) <= exp (lambda ^ 2 * v / 2)) ->
  E (ind_ge Y x) <= exp (- x ^ 2 / (2 * v)).
Proof.
  intros Hv Hx Hmgf. set (lambda := x / v).
  assert (Hl : 0 <= lambda) by (apply Rmult_le_pos; [lra|left; apply Rinv_0_lt_compat; lra]).
  apply Rle_trans with (E (fun w => exp (- (lambda * x)) * exp (lambda * Y w))).
  { apply E_mono. intros w. rewrite <- exp_plus.
    replace (- (lambda * x) + lambda * Y w) with (lambda * (Y w - x)) by ring.
    apply ind_ge_le_exp. exact Hl. }
  rewrite E_scal.
  apply Rle_trans with (exp (- (lambda * x)) * exp (lambda ^ 2 * v / 2)).
  { apply Rmult_le_compat_l; [left; apply exp_pos|apply Hmgf]. }
  rewrite <- exp_plus. right. f_equal. unfold lambda. field. lra.
Qed.

(** Chernoff's tail bound over an ABSTRACT expectation E (any monotone, additive,
    homogeneous operator; no measure theory): a variable whose moment generating function
    is at most exp(lambda^2 v / 2) for every lambda has P(|X| >= x) <= 2 exp(-x^2 / (2 v)). *)
Theorem tail_le_of_mgf_le (X : Omega -> R) (v x : R) :
  0 < v -> 0 <= x ->
  (forall lambda, E (fun w => exp (lambda * X w)) <= exp (lambda ^ 2 * v / 2)) ->
  E (ind_ge (fun w => Rabs (X w)) x) <= 2 * exp (- x ^ 2 / (2 * v)).
Proof.
  intros Hv Hx Hmgf.
  apply Rle_trans with (E (fun w => ind_ge X x w + ind_ge (fun w => - X w) x w)).
  { apply E_mono. intros w. unfold ind_ge.
    destruct (Rle_dec x (Rabs (X w))) as [H|H];
    destruct (Rle_dec x (X w)); destruct (Rle_dec x (- X w)); try lra.
    revert H. unfold Rabs. destruct (Rcase_abs (X w)); lra. }
  rewrite E_add.
  assert (H1 := tail_ge_le_of_mgf_le X v x Hv Hx Hmgf).
  assert (H2 : E (ind_ge (fun w => - X w) x) <= exp (- x ^ 2 / (2 * v))).
  { apply tail_ge_le_of_mgf_le; [exact Hv|exact Hx|]. intros lambda.
    rewrite (E_ext _ (fun w => exp ((- lambda) * X w))) by (intros; f_equal; ring).
    replace (lambda ^ 2) with ((- lambda) ^ 2) by ring. apply Hmgf. }
  lra.
Qed.

(** Product rule: if E factorises over the exponentials of n independent terms and each
    term has MGF at most exp(lambda^2 v_i / 2), their sum has MGF at most
    exp(lambda^2 (sum v_i) / 2). Independence enters only through the hypothesis [Hind]. *)
Lemma mgf_sum_le_of_indep (n : nat) (Xs : nat -> Omega -> R) (vs : nat -> R) (lambda : R) :
  E (fun w => rprod n (fun i => exp (lambda * Xs i w)))
    = rprod n (fun i => E (fun w => exp (lambda * Xs i w))) ->
  (forall i, (i < n)%nat -> E (fun w => exp (lambda * Xs i w)) <= exp (lambda ^ 2 * vs i / 2)) ->
  E (fun w => exp (lambda * sum n (fun i => Xs i w))) <= exp (lambda ^ 2 * sum n vs / 2).
Proof.
  intros Hind Hi.
  rewrite (E_ext _ (fun w => rprod n (fun i => exp (lambda * Xs i w)))).
  - rewrite Hind.
    replace (lambda ^ 2 * sum n vs / 2) with (sum n (fun i => lambda ^ 2 * vs i / 2)).
    + rewrite exp_sum_eq_rprod. apply rprod_le. intros i Hin. split.
      * apply E_nonneg. intros; left; apply exp_pos.
      * apply Hi. exact Hin.
    + unfold Rdiv. rewrite sum_scal_r, sum_scal_l. reflexivity.
  - intros w. rewrite <- sum_scal_l. apply exp_sum_eq_rprod.
Qed.

(** Two-sided tail of a sum of independent sub-Gaussian terms. *)
Lemma sum_tail_le_of_indep (n : nat) (Xs : nat -> Omega -> R) (vs : nat -> R) (x : R) :
  0 < sum n vs -> 0 <= x ->
  (forall lambda, E (fun w => rprod n (fun i => exp (lambda * Xs i w)))
    = rprod n (fun i => E (fun w => exp (lambda * Xs i w)))) ->
  (forall lambda i, (i < n)%nat ->
    E (fun w => exp (lambda * Xs i w)) <= exp (lambda ^ 2 * vs i / 2)) ->
  E (ind_ge (fun w => Rabs (sum n (fun i => Xs i w))) x)
    <= 2 * exp (- x ^ 2 / (2 * sum n vs)).
Proof.
  intros Hv Hx Hind Hi.
  apply (tail_le_of_mgf_le (fun w => sum n (fun i => Xs i w))); [exact Hv|exact Hx|].
  intros lambda. apply mgf_sum_le_of_indep; [apply Hind|]. intros; apply Hi; assumption.
Qed.

End Chernoff.

(** * T6d *)

(** The per-read radius c = sigma sqrt(2 ln(2n/d)) spends exactly the local budget d in
    the union bound over the n tokens of one read. *)
Theorem union_bound_eq_of_radius (n : nat) (d sigma c : R) :
  (0 < n)%nat -> 0 < d -> d <= 2 * INR n -> 0 < sigma ->
  c = sigma * sqrt (2 * ln (2 * INR n / d)) ->
  INR n * (2 * exp (- c ^ 2 / (2 * sigma ^ 2))) = d.
Proof.
  intros Hn Hd Hdn Hs Hc.
  assert (Hn' : 0 < INR n) by (apply lt_0_INR; lia).
  assert (Hq : 1 <= 2 * INR n / d).
  { apply (Rmult_le_reg_r d); [lra|]. unfold Rdiv. rewrite Rmult_assoc, Rinv_l; lra. }
  assert (Hl : 0 <= ln (2 * INR n / d)) by (rewrite <- ln_1; apply ln_le; lra).
  assert (Hc2 : c ^ 2 = sigma ^ 2 * (2 * ln (2 * INR n / d))).
  { rewrite Hc, Rpow_mult_distr. f_equal. rewrite <- Rsqr_pow2. apply Rsqr_sqrt. lra. }
  replace (- c ^ 2 / (2 * sigma ^ 2)) with (- ln (2 * INR n / d))
    by (rewrite Hc2; field; lra).
  rewrite exp_Ropp, exp_ln by lra. field. lra.
Qed.

(** * T6e *)

Lemma budget_schedule_sum_eq T :
  sum T (fun i => 1 / (INR (S i) * (INR (S i) + 1))) = 1 - 1 / (INR T + 1).
Proof.
  induction T as [|T IH]; [simpl; field|].
  rewrite sum_succ, IH, S_INR.
  assert (0 <= INR T) by apply pos_INR. field. lra.
Qed.

(** The any-time schedule 1/(t(t+1)), t = 1, 2, ..., never spends more than the whole
    budget, whatever the number of steps T. *)
Theorem budget_schedule_sum_le_one T :
  sum T (fun i => 1 / (INR (S i) * (INR (S i) + 1))) <= 1.
Proof.
  rewrite budget_schedule_sum_eq.
  assert (0 <= INR T) by apply pos_INR.
  assert (0 < 1 / (INR T + 1)) by (apply Rdiv_lt_0_compat; lra). lra.
Qed.

(** Splitting delta_req into local budgets delta_req/(L H t (t+1)) over L layers, H heads
    and steps t = 1..T keeps the total failure probability of a request within delta_req. *)
Theorem request_failure_le_of_budget (L H T : nat) (delta_req : R) :
  (0 < L)%nat -> (0 < H)%nat -> 0 <= delta_req ->
  sum T (fun i => sum (L * H)
    (fun _ => delta_req / (INR L * INR H * INR (S i) * (INR (S i) + 1)))) <= delta_req.
Proof.
  intros HL HH Hd.
  assert (HL' : 0 < INR L) by (apply lt_0_INR; lia).
  assert (HH' : 0 < INR H) by (apply lt_0_INR; lia).
  rewrite (sum_ext T _ (fun i => delta_req * (1 / (INR (S i) * (INR (S i) + 1))))).
  - rewrite sum_scal_l. pose proof (budget_schedule_sum_le_one T).
    rewrite <- (Rmult_1_r delta_req) at 2. apply Rmult_le_compat_l; lra.
  - intros i _. rewrite sum_const, mult_INR.
    assert (0 < INR (S i)) by (apply lt_0_INR; lia). field. repeat split; lra.
Qed.
