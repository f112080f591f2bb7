"""Checkpoints: where a run starts (``sources``: one Source per format, detected once), ours
(Orbax, ``orbax``; the loop's save hook ``saver``; checksum manifests and the ``--save`` lock
``integrity``), Hugging Face directories (``hf``) and Megatron-LM / AIAK ones (``megatron/``)."""
