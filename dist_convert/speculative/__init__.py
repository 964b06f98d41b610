"""``speculate``: EAGLE / Medusa drafts added with NVIDIA ModelOpt at a target layout, saved sharded."""
