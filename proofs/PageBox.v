(** T7i-T7m: page box witnesses of the evicted keys (issue 22). Per page of evicted tokens
    the elementwise box [lo, hi] of their keys; for a query q the box's exact maximum
    [s * sum_i max(q_i lo_i, q_i hi_i)] bounds every evicted logit of the page. *)
From KVCert Require Import Prelim Band Softmax Evict.
From Coq Require Import Reals Lra Lia.
Open Scope R_scope.

(** The maximum of [<q, k>] over the box [lo <= k <= hi], coordinate by coordinate. *)
Definition box_max (D : nat) (q lo hi : nat -> R) : R :=
  sum D (fun i => Rmax (q i * lo i) (q i * hi i)).

Definition in_box (D : nat) (lo hi k : nat -> R) : Prop :=
  forall i, (i < D)%nat -> lo i <= k i <= hi i.

(** ** T7i *)

(** Every key in the box has its logit below the box maximum, for every query. *)
Theorem logit_le_box_max D s q lo hi k :
  0 <= s -> in_box D lo hi k -> s * inner D q k <= s * box_max D q lo hi.
Proof.
  intros Hs Hk. apply Rmult_le_compat_l; [exact Hs|].
  unfold inner, box_max. apply sum_le. intros i Hi. destruct (Hk i Hi) as [Hl Hh].
  destruct (Rle_dec 0 (q i)) as [Hq|Hq].
  - eapply Rle_trans; [|apply Rmax_r]. apply Rmult_le_compat_l; assumption.
  - eapply Rle_trans; [|apply Rmax_l]. nra.
Qed.

(** The bound is the exact maximum: the corner that takes [hi] where [q >= 0] and [lo]
    elsewhere lies in the box and attains it, so no bound built from the box alone is lower. *)
Theorem box_max_attained D q lo hi :
  (forall i, (i < D)%nat -> lo i <= hi i) ->
  let corner := fun i => if Rle_dec 0 (q i) then hi i else lo i in
  in_box D lo hi corner /\ inner D q corner = box_max D q lo hi.
Proof.
  intros Hlh corner. split.
  - intros i Hi. unfold corner. specialize (Hlh i Hi). destruct (Rle_dec 0 (q i)); lra.
  - unfold inner, box_max. apply sum_ext. intros i Hi. unfold corner. specialize (Hlh i Hi).
    destruct (Rle_dec 0 (q i)) as [Hq|Hq].
    + rewrite Rmax_right; [reflexivity|]. apply Rmult_le_compat_l; assumption.
    + rewrite Rmax_left; [reflexivity|]. nra.
Qed.

(** Outward rounding and unions: a box that contains [[lo, hi]] contains its keys. The stored
    box (lo rounded down, hi rounded up) and a super-page's box (elementwise min of the pages'
    lo, max of their hi) are such boxes. *)
Theorem in_box_widen D lo hi lo' hi' k :
  (forall i, (i < D)%nat -> lo' i <= lo i /\ hi i <= hi' i) ->
  in_box D lo hi k -> in_box D lo' hi' k.
Proof.
  intros Hw Hk i Hi. destruct (Hw i Hi), (Hk i Hi). split; lra.
Qed.

(** ** T7j *)

(** Any per-group upper bound on the evicted logits bounds [Z_E] by counts times exponentials
    (the structure of [z_evicted_le_group_witness], for any bound [Bd]). *)
Lemma z_evicted_le_of_group_bounds n kept x G group (Bd : nat -> R) :
  (forall j, (j < n)%nat -> kept j = false -> (group j < G)%nat) ->
  (forall j, (j < n)%nat -> kept j = false -> x j <= Bd (group j)) ->
  z_evicted n kept x <= sum G (fun g => INR (group_count n kept group g) * exp (Bd g)).
Proof.
  intros HG Hle.
  apply Rle_trans with (sum n (fun j => if kept j then 0 else exp (Bd (group j)))).
  - apply sum_le. intros j Hj. destruct (kept j) eqn:Hk; [lra|].
    destruct (Hle j Hj Hk) as [Hlt|Heq]; [left; apply exp_increasing; exact Hlt|rewrite Heq; lra].
  - rewrite (sum_eq_sum_bands n G group).
    + right. apply sum_ext. intros g _. rewrite INR_group_count, <- sum_scal_r.
      apply sum_ext. intros j _.
      destruct (Nat.eqb_spec (group j) g) as [E|E]; [rewrite E|]; destruct (kept j); ring.
    + intros j Hj. destruct (kept j) eqn:Hk; [right; reflexivity|].
      left. apply HG; assumption.
Qed.

(** Page boxes bound the evicted mass: [Z_E <= sum_p n_p exp(s box_max(q, lo_p, hi_p))] for
    any assignment [page] of the evicted tokens to boxes that contain their keys (pages of
    consecutive tokens, clusters, or the mixed cover of pages and super-pages). *)
Theorem z_evicted_le_page_box n kept x D P page s q (k lo hi : nat -> nat -> R) :
  0 <= s ->
  (forall j, (j < n)%nat -> kept j = false -> (page j < P)%nat) ->
  (forall j, (j < n)%nat -> kept j = false -> in_box D (lo (page j)) (hi (page j)) (k j)) ->
  (forall j, (j < n)%nat -> x j = s * inner D q (k j)) ->
  z_evicted n kept x
  <= sum P (fun p => INR (group_count n kept page p) * exp (s * box_max D q (lo p) (hi p))).
Proof.
  intros Hs HP Hbox Hx.
  apply (z_evicted_le_of_group_bounds n kept x P page (fun p => s * box_max D q (lo p) (hi p))).
  - exact HP.
  - intros j Hj Hk. rewrite Hx by exact Hj. apply logit_le_box_max; [exact Hs|]. apply Hbox; assumption.
Qed.

(** ** T7k *)

(** The page box certificate: with [L <= Z_K], TV(p, p^K) <= X/(L+X); and composed with any
    bound T on the kept part (quantized kept keys, T7g), TV(p, p~^K) <= X/(L+X) + T. *)
Theorem tv_evict_le_page_box n kept x xt D P page s q (k lo hi : nat -> nat -> R) L T :
  0 <= s ->
  (forall j, (j < n)%nat -> kept j = false -> (page j < P)%nat) ->
  (forall j, (j < n)%nat -> kept j = false -> in_box D (lo (page j)) (hi (page j)) (k j)) ->
  (forall j, (j < n)%nat -> x j = s * inner D q (k j)) ->
  0 < L -> L <= z_kept n kept x ->
  tv n (softmax_kept n kept x) (softmax_kept n kept xt) <= T ->
  let X := sum P (fun p => INR (group_count n kept page p) * exp (s * box_max D q (lo p) (hi p))) in
  tv n (softmax n x) (softmax_kept n kept x) <= X / (L + X)
  /\ tv n (softmax n x) (softmax_kept n kept xt) <= X / (L + X) + T.
Proof.
  intros Hs HP Hbox Hx HL HK HT X.
  assert (HX : z_evicted n kept x <= X) by (apply (z_evicted_le_page_box n kept x D P page s q k); assumption).
  split.
  - apply evict_tv_le_of_z_bounds; assumption.
  - apply tv_evict_quant_le_of_kept_tv; assumption.
Qed.

(** ** T7l *)

(** A box of the STORED key, widened by the key's band witness, bounds the EXACT key's logit:
    s<q, k> <= s box_max(q, lo, hi) + s sum_b ||q_b|| W_b when k~ lies in the box and
    ||(k - k~)_b|| <= W_b. *)
Theorem logit_le_widened_box D NB band s q lo hi k kt (W : nat -> R) :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  0 <= s ->
  in_box D lo hi kt ->
  (forall b, (b < NB)%nat -> band_norm D band (fun i => k i - kt i) b <= W b) ->
  s * inner D q k <= s * box_max D q lo hi + s * sum NB (fun b => band_norm D band q b * W b).
Proof.
  intros Hband Hs Hbox HW.
  assert (Hbm := logit_le_box_max D s q lo hi kt Hs Hbox).
  assert (He := abs_logit_sub_le_of_witness D NB band s q k kt W Hband Hs HW).
  assert (Hr := Rle_abs (s * inner D q k - s * inner D q kt)). lra.
Qed.

(** Widened page boxes of the stored evicted keys bound the evicted mass of the exact keys:
    per page the box of its stored keys and W_{p,b} >= rho_{j,b} for its tokens. *)
Theorem z_evicted_le_widened_page_box n kept x D NB band P page s q (k kt lo hi W : nat -> nat -> R) :
  (forall i, (i < D)%nat -> (band i < NB)%nat) ->
  0 <= s ->
  (forall j, (j < n)%nat -> kept j = false -> (page j < P)%nat) ->
  (forall j, (j < n)%nat -> kept j = false -> in_box D (lo (page j)) (hi (page j)) (kt j)) ->
  (forall j, (j < n)%nat -> kept j = false -> forall b, (b < NB)%nat ->
     band_norm D band (fun i => k j i - kt j i) b <= W (page j) b) ->
  (forall j, (j < n)%nat -> x j = s * inner D q (k j)) ->
  z_evicted n kept x
  <= sum P (fun p => INR (group_count n kept page p)
                     * exp (s * box_max D q (lo p) (hi p)
                            + s * sum NB (fun b => band_norm D band q b * W p b))).
Proof.
  intros Hband Hs HP Hbox HW Hx.
  apply (z_evicted_le_of_group_bounds n kept x P page
           (fun p => s * box_max D q (lo p) (hi p) + s * sum NB (fun b => band_norm D band q b * W p b))).
  - exact HP.
  - intros j Hj Hk. rewrite Hx by exact Hj.
    apply (logit_le_widened_box D NB band s q _ _ (k j) (kt j)); [exact Hband|exact Hs| |].
    + apply Hbox; assumption.
    + intros b Hb. apply HW; assumption.
Qed.

(** ** T7m *)

(** The split used by the fast code: max(q lo, q hi) = max(q, 0) hi + min(q, 0) lo, so the
    box maximum is two dot products (with the positive and the negative part of q). *)
Theorem box_max_split D q lo hi :
  (forall i, (i < D)%nat -> lo i <= hi i) ->
  box_max D q lo hi = inner D (fun i => Rmax (q i) 0) hi + inner D (fun i => Rmin (q i) 0) lo.
Proof.
  intros Hlh. unfold box_max, inner. rewrite <- sum_add. apply sum_ext. intros i Hi.
  specialize (Hlh i Hi). destruct (Rle_dec 0 (q i)) as [Hq|Hq].
  - rewrite (Rmax_left (q i) 0), (Rmin_right (q i) 0), (Rmax_right (q i * lo i)) by nra. ring.
  - rewrite (Rmax_right (q i) 0), (Rmin_left (q i) 0), (Rmax_left (q i * lo i)) by nra. ring.
Qed.
