"""A node's state on disk and between peers. It never imports roles.

Files:
    checkpoint_dir.py     the checkpoint directory format: write, verify, place atomically, load,
                          temp dirs (shared with the coordinator's store)
    checkpoint_client.py  download / upload checkpoints between peers, verified as they arrive
    state_server.py       serve checkpoint directories over RPC (roles and the coordinator)
    model_files.py        a Hugging Face model's config and tokenizer files, pinned by hash:
                          packed by the coordinator, fetched and checked by nodes
"""
