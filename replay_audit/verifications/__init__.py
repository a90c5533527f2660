"""Verification (provider audit): are a group's logged tokens consistent with the claimed
checkpoint and configuration? The evidence is the reference's per-token deficit along the logged
path (`diff.deficit`, from the scan); the null is the checkpoint's benign numerics, measured per
scanning platform (`null`); the statistics and the verdict are `stats.verification`'s."""
