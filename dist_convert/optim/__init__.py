"""The distributed optimizer's state (``reshard --optimizer``): logical tensors and common state (``state``),
megatron-core's bucket-space layout (``buckets``, pure), and what each source format holds (``read``,
``sources``)."""
