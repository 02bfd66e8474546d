(** Umbrella: the whole kvcert development. The statements are listed in spec/theorems.toml. *)
From KVCert Require Export Prelim Softmax Rope Band Subspace Value Dither DitherGrid DitherCode Evict PageBox Float FloatCast FloatDot Codec Served Box BoxMerge.
