From KVCert Require Import Prelim Softmax.
From Coq Require Import Reals Lra Lia.
Open Scope R_scope.

(** Issue 20: the worst case of TV over per-token shift intervals, bounded by weak duality.
    [p = softmax x], [q = softmax xt], [lo_j <= x_j - xt_j <= hi_j]. For the set S where
    [p > q], TV = p(S) - q(S) and p(S) <= V := a_S / (a_S + b_{S^c}) with [a = q e^hi],
    [b = q e^lo]. Since sum_S w_j(V) = V B for w_j(u) = (1 - u) a_j + u b_j, every lambda >= 0
    gives q(S) >= lambda V B - sum_j (lambda w_j(V) - q_j)^+, i.e. TV <= box_e V lambda.
    box_e is convex in u, so a grid 0 = g_0 <= ... <= g_K = 1 bounds it by end values.
    [box_e] takes an enclosure [ql <= q <= qh] of q (what a floating-point kernel knows). *)

Definition kappa (lo hi : nat -> R) (u lam : R) (j : nat) : R :=
  lam * ((1 - u) * exp (hi j) + u * exp (lo j)) - 1.

Definition box_e (n : nat) (ql qh lo hi : nat -> R) (u lam : R) : R :=
  u - lam * u * sum n (fun j => ql j * exp (lo j))
    + sum n (fun j => qh j * Rmax 0 (kappa lo hi u lam j)).

(** * Sets as 0/1 indicators *)

Lemma sum_indicator_le n (s f : nat -> R) :
  (forall j, (j < n)%nat -> s j = 0 \/ s j = 1) ->
  sum n (fun j => s j * f j) <= sum n (fun j => Rmax 0 (f j)).
Proof.
  intros Hs. apply sum_le. intros j Hj.
  destruct (Hs j Hj) as [H|H]; rewrite H; [rewrite Rmult_0_l; apply Rmax_l|rewrite Rmult_1_l; apply Rmax_r].
Qed.

(** x / (x + y) increases in x and decreases in y: N/(N+M) <= a/(a+b) when N <= a, b <= M. *)
Lemma frac_mono N M a b :
  0 <= N -> 0 <= b -> N <= a -> b <= M -> 0 < N + M -> 0 < a + b ->
  N / (N + M) <= a / (a + b).
Proof.
  intros HN Hb Ha HM H1 H2.
  apply Rmult_le_reg_r with ((N + M) * (a + b)); [apply Rmult_lt_0_compat; lra|].
  replace (N / (N + M) * ((N + M) * (a + b))) with (N * (a + b)) by (field; lra).
  replace (a / (a + b) * ((N + M) * (a + b))) with (a * (N + M)) by (field; lra).
  nra.
Qed.

Lemma rmax0_scal c k : 0 <= c -> Rmax 0 (c * k) = c * Rmax 0 k.
Proof.
  intros Hc. unfold Rmax. destruct (Rle_dec 0 (c * k)) as [H1|H1]; destruct (Rle_dec 0 k) as [H2|H2].
  - reflexivity.
  - destruct Hc as [Hc|Hc]; [|subst; ring]. exfalso. assert (0 < c * - k) by (apply Rmult_lt_0_compat; lra). lra.
  - exfalso. apply H1. apply Rmult_le_pos; lra.
  - ring.
Qed.

(** * The core: TV <= box_e V lambda for one V in [0, 1] and every lambda >= 0 *)

Theorem tv_le_box_e n x xt lo hi :
  (0 < n)%nat -> (forall j, (j < n)%nat -> lo j <= x j - xt j <= hi j) ->
  exists V, 0 <= V <= 1 /\
    forall lam, 0 <= lam ->
      tv n (softmax n x) (softmax n xt) <= box_e n (softmax n xt) (softmax n xt) lo hi V lam.
Proof.
  intros Hn Hb.
  set (q := softmax n xt). set (p := softmax n x).
  set (s := fun j => if Rlt_dec (q j) (p j) then 1 else 0).
  assert (Hs : forall j, (j < n)%nat -> s j = 0 \/ s j = 1)
    by (intros j _; unfold s; destruct (Rlt_dec (q j) (p j)); auto).
  assert (Hq : forall j, (j < n)%nat -> 0 < q j) by (intros; apply softmax_pos; exact Hn).
  set (eps := fun j => x j - xt j).
  set (Z := sum n (fun j => q j * exp (eps j))).
  assert (HZ : 0 < Z) by (apply sum_pos; [exact Hn|intros j Hj; apply Rmult_lt_0_compat; [apply Hq; exact Hj|apply exp_pos]]).
  assert (Hp : forall j, (j < n)%nat -> p j = q j * exp (eps j) / Z)
    by (intros j _; apply softmax_eq_tilt; exact Hn).
  set (aS := sum n (fun j => s j * (q j * exp (hi j)))).
  set (bS := sum n (fun j => s j * (q j * exp (lo j)))).
  set (bC := sum n (fun j => (1 - s j) * (q j * exp (lo j)))).
  set (Bt := sum n (fun j => q j * exp (lo j))).
  set (NS := sum n (fun j => s j * (q j * exp (eps j)))).
  set (MC := sum n (fun j => (1 - s j) * (q j * exp (eps j)))).
  assert (Hs01 : forall j, (j < n)%nat -> 0 <= s j <= 1) by (intros j Hj; destruct (Hs j Hj) as [H|H]; lra).
  assert (HBt : Bt = bS + bC) by (unfold Bt, bS, bC; rewrite <- sum_add; apply sum_ext; intros; ring).
  assert (HZs : Z = NS + MC) by (unfold Z, NS, MC; rewrite <- sum_add; apply sum_ext; intros; ring).
  assert (HaN : NS <= aS).
  { apply sum_le. intros j Hj. destruct (Hs01 j Hj). assert (0 < q j) by (apply Hq; exact Hj).
    assert (exp (eps j) <= exp (hi j)) by (apply exp_mono; unfold eps; destruct (Hb j Hj); lra).
    assert (q j * exp (eps j) <= q j * exp (hi j)) by (apply Rmult_le_compat_l; lra). nra. }
  assert (HbM : bC <= MC).
  { apply sum_le. intros j Hj. destruct (Hs01 j Hj). assert (0 < q j) by (apply Hq; exact Hj).
    assert (exp (lo j) <= exp (eps j)) by (apply exp_mono; unfold eps; destruct (Hb j Hj); lra).
    assert (q j * exp (lo j) <= q j * exp (eps j)) by (apply Rmult_le_compat_l; lra). nra. }
  assert (HN0 : 0 <= NS) by (apply sum_nonneg; intros j Hj; destruct (Hs01 j Hj);
    apply Rmult_le_pos; [lra|apply Rmult_le_pos; [left; apply Hq; exact Hj|left; apply exp_pos]]).
  assert (HbC0 : 0 <= bC) by (apply sum_nonneg; intros j Hj; destruct (Hs01 j Hj);
    apply Rmult_le_pos; [lra|apply Rmult_le_pos; [left; apply Hq; exact Hj|left; apply exp_pos]]).
  assert (HbS0 : 0 <= bS) by (apply sum_nonneg; intros j Hj; destruct (Hs01 j Hj);
    apply Rmult_le_pos; [lra|apply Rmult_le_pos; [left; apply Hq; exact Hj|left; apply exp_pos]]).
  assert (HBpos : 0 < Bt) by (apply sum_pos; [exact Hn|intros j Hj; apply Rmult_lt_0_compat; [apply Hq; exact Hj|apply exp_pos]]).
  assert (Hab : bS <= aS).
  { apply sum_le. intros j Hj. destruct (Hs01 j Hj). assert (0 < q j) by (apply Hq; exact Hj).
    assert (exp (lo j) <= exp (hi j)) by (apply exp_mono; destruct (Hb j Hj); lra).
    assert (q j * exp (lo j) <= q j * exp (hi j)) by (apply Rmult_le_compat_l; lra). nra. }
  assert (HD : 0 < aS + bC) by lra.
  set (V := aS / (aS + bC)).
  assert (HV : 0 <= V <= 1).
  { unfold V. split; [unfold Rdiv; apply Rmult_le_pos; [lra|left; apply Rinv_0_lt_compat; lra]|].
    apply Rmult_le_reg_r with (aS + bC); [lra|]. unfold Rdiv. rewrite Rmult_assoc, Rinv_l by lra. lra. }
  exists V. split; [exact HV|]. intros lam Hlam.
  (* TV = p(S) - q(S) *)
  assert (Hsq : sum n q = 1) by (apply softmax_sum; exact Hn).
  assert (Hsp : sum n p = 1) by (apply softmax_sum; exact Hn).
  assert (Htv : tv n p q = sum n (fun j => s j * p j) - sum n (fun j => s j * q j)).
  { rewrite tv_eq_sum_pos_part by lra. rewrite <- sum_sub. apply sum_ext. intros j _.
    unfold s. destruct (Rlt_dec (q j) (p j)); unfold Rmax; destruct (Rle_dec 0 (p j - q j)); lra. }
  (* p(S) <= V *)
  assert (HpS : sum n (fun j => s j * p j) = NS / (NS + MC)).
  { rewrite <- HZs. unfold NS. unfold Rdiv. rewrite <- sum_scal_r. apply sum_ext. intros j Hj.
    rewrite Hp by exact Hj. unfold Rdiv. ring. }
  assert (HpV : sum n (fun j => s j * p j) <= V) by (rewrite HpS; unfold V; apply frac_mono; lra).
  (* sum_S w_j(V) = V B *)
  assert (Hw : sum n (fun j => s j * (q j * ((1 - V) * exp (hi j) + V * exp (lo j)))) = V * Bt).
  { rewrite (sum_ext n _ (fun j => (1 - V) * (s j * (q j * exp (hi j))) + V * (s j * (q j * exp (lo j)))))
      by (intros; ring).
    rewrite sum_add, !sum_scal_l. fold aS bS. rewrite HBt.
    assert (HVD : V * (aS + bC) = aS) by (unfold V; field; lra). nra. }
  (* weak duality: q(S) >= lam V B - sum (lam w_j - q_j)^+ *)
  assert (Hdual : lam * V * Bt - sum n (fun j => q j * Rmax 0 (kappa lo hi V lam j))
                  <= sum n (fun j => s j * q j)).
  { assert (Hind : sum n (fun j => s j * (q j * kappa lo hi V lam j))
                   <= sum n (fun j => Rmax 0 (q j * kappa lo hi V lam j)))
      by (apply sum_indicator_le; exact Hs).
    assert (Hpos : sum n (fun j => Rmax 0 (q j * kappa lo hi V lam j))
                   = sum n (fun j => q j * Rmax 0 (kappa lo hi V lam j))).
    { apply sum_ext. intros j Hj. apply rmax0_scal. left. apply Hq. exact Hj. }
    assert (Hexp : sum n (fun j => s j * (q j * kappa lo hi V lam j))
                   = lam * sum n (fun j => s j * (q j * ((1 - V) * exp (hi j) + V * exp (lo j))))
                     - sum n (fun j => s j * q j)).
    { rewrite <- sum_scal_l, <- sum_sub. apply sum_ext. intros j _. unfold kappa. ring. }
    rewrite Hw in Hexp. lra. }
  unfold box_e. fold q p. fold Bt. rewrite Htv. lra.
Qed.

(** * An enclosure of q: box_e is nonincreasing in ql and nondecreasing in qh *)

Lemma box_e_enclosure n q ql qh lo hi u lam :
  0 <= u -> 0 <= lam -> (forall j, (j < n)%nat -> ql j <= q j <= qh j) ->
  box_e n q q lo hi u lam <= box_e n ql qh lo hi u lam.
Proof.
  intros Hu Hl Hq. unfold box_e.
  assert (sum n (fun j => ql j * exp (lo j)) <= sum n (fun j => q j * exp (lo j))).
  { apply sum_le. intros j Hj. destruct (Hq j Hj). assert (0 < exp (lo j)) by apply exp_pos. nra. }
  assert (sum n (fun j => q j * Rmax 0 (kappa lo hi u lam j)) <= sum n (fun j => qh j * Rmax 0 (kappa lo hi u lam j))).
  { apply sum_le. intros j Hj. destruct (Hq j Hj). assert (0 <= Rmax 0 (kappa lo hi u lam j)) by apply Rmax_l. nra. }
  assert (0 <= lam * u) by nra. nra.
Qed.

(** * Convexity in u: between two levels, box_e is at most its larger end value *)

Lemma rmax0_convex t a b : 0 <= t <= 1 -> Rmax 0 ((1 - t) * a + t * b) <= (1 - t) * Rmax 0 a + t * Rmax 0 b.
Proof.
  intros Ht. assert (a <= Rmax 0 a) by apply Rmax_r. assert (0 <= Rmax 0 a) by apply Rmax_l.
  assert (b <= Rmax 0 b) by apply Rmax_r. assert (0 <= Rmax 0 b) by apply Rmax_l.
  apply Rmax_lub; nra.
Qed.

Lemma box_e_convex n ql qh lo hi u0 u1 u lam :
  (forall j, (j < n)%nat -> 0 <= qh j) -> u0 <= u <= u1 ->
  box_e n ql qh lo hi u lam <= Rmax (box_e n ql qh lo hi u0 lam) (box_e n ql qh lo hi u1 lam).
Proof.
  intros Hqh Hu.
  destruct (Req_dec u0 u1) as [Heq|Hne].
  - subst u1. replace u with u0 by lra. apply Rmax_l.
  - set (t := (u - u0) / (u1 - u0)).
    assert (Ht : 0 <= t <= 1).
    { unfold t. split; [unfold Rdiv; apply Rmult_le_pos; [lra|left; apply Rinv_0_lt_compat; lra]|].
      apply Rmult_le_reg_r with (u1 - u0); [lra|]. unfold Rdiv. rewrite Rmult_assoc, Rinv_l by lra. lra. }
    assert (Hu_eq : u = (1 - t) * u0 + t * u1) by (unfold t; field; lra).
    assert (Hk : forall j, kappa lo hi u lam j = (1 - t) * kappa lo hi u0 lam j + t * kappa lo hi u1 lam j)
      by (intros j; unfold kappa; rewrite Hu_eq; ring).
    assert (Hc : box_e n ql qh lo hi u lam
                 <= (1 - t) * box_e n ql qh lo hi u0 lam + t * box_e n ql qh lo hi u1 lam).
    { unfold box_e.
      assert (sum n (fun j => qh j * Rmax 0 (kappa lo hi u lam j))
              <= (1 - t) * sum n (fun j => qh j * Rmax 0 (kappa lo hi u0 lam j))
                 + t * sum n (fun j => qh j * Rmax 0 (kappa lo hi u1 lam j))).
      { rewrite <- !sum_scal_l, <- sum_add. apply sum_le. intros j Hj. rewrite Hk.
        assert (H := rmax0_convex t (kappa lo hi u0 lam j) (kappa lo hi u1 lam j) Ht).
        assert (0 <= qh j) by (apply Hqh; exact Hj). nra. }
      rewrite Hu_eq at 1 2. nra. }
    assert (box_e n ql qh lo hi u0 lam <= Rmax (box_e n ql qh lo hi u0 lam) (box_e n ql qh lo hi u1 lam)) by apply Rmax_l.
    assert (box_e n ql qh lo hi u1 lam <= Rmax (box_e n ql qh lo hi u0 lam) (box_e n ql qh lo hi u1 lam)) by apply Rmax_r.
    nra.
Qed.

(** * A grid of levels covers [0, 1] *)

Lemma grid_cover (g : nat -> R) V K :
  (forall k, (k <= K)%nat -> g k <= g (S k)) -> g 0%nat <= V -> V <= g (S K) ->
  exists k, (k <= K)%nat /\ g k <= V <= g (S k).
Proof.
  induction K as [|K IH]; intros Hm H0 H1.
  - exists 0%nat. split; [lia|lra].
  - destruct (Rle_dec V (g (S K))) as [Hle|Hgt].
    + destruct IH as [k [Hk Hv]]; [intros; apply Hm; lia|exact H0|exact Hle|].
      exists k. split; [lia|exact Hv].
    + exists (S K). split; [lia|lra].
Qed.

(** * The certificate: some interval of any grid bounds TV for every lambda >= 0 *)

Theorem tv_le_box_grid n x xt lo hi ql qh (g : nat -> R) K :
  (0 < n)%nat -> (forall j, (j < n)%nat -> lo j <= x j - xt j <= hi j) ->
  (forall j, (j < n)%nat -> ql j <= softmax n xt j <= qh j) ->
  g 0%nat = 0 -> g (S K) = 1 -> (forall k, (k <= K)%nat -> g k <= g (S k)) ->
  exists k, (k <= K)%nat /\ forall lam, 0 <= lam ->
    tv n (softmax n x) (softmax n xt)
    <= Rmax (box_e n ql qh lo hi (g k) lam) (box_e n ql qh lo hi (g (S k)) lam).
Proof.
  intros Hn Hb Hq H0 H1 Hm.
  destruct (tv_le_box_e n x xt lo hi Hn Hb) as [V [HV Htv]].
  destruct (grid_cover g V K Hm) as [k [Hk Hgk]]; [lra|lra|].
  exists k. split; [exact Hk|]. intros lam Hlam.
  assert (Hqh : forall j, (j < n)%nat -> 0 <= qh j).
  { intros j Hj. destruct (Hq j Hj). assert (0 < softmax n xt j) by (apply softmax_pos; exact Hn). lra. }
  apply Rle_trans with (box_e n (softmax n xt) (softmax n xt) lo hi V lam); [apply Htv; exact Hlam|].
  apply Rle_trans with (box_e n ql qh lo hi V lam); [apply box_e_enclosure; [lra|exact Hlam|exact Hq]|].
  apply box_e_convex; [exact Hqh|exact Hgk].
Qed.

(** lambda = 0 gives box_e u 0 = u (with qh >= 0): an interval's term never exceeds its top level. *)
Lemma box_e_lam0 n ql qh lo hi u :
  (forall j, (j < n)%nat -> 0 <= qh j) -> box_e n ql qh lo hi u 0 = u.
Proof.
  intros Hqh. unfold box_e.
  rewrite (sum_ext n (fun j => qh j * Rmax 0 (kappa lo hi u 0 j)) (fun _ => 0)).
  - replace (sum n (fun _ => 0)) with 0 by (rewrite sum_const; ring). ring.
  - intros j _. unfold kappa. replace (0 * ((1 - u) * exp (hi j) + u * exp (lo j)) - 1) with (-1) by ring.
    rewrite Rmax_left by lra. ring.
Qed.
