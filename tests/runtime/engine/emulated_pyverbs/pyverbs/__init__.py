"""A test double of rdma-core's pyverbs (the names monarch's verbs backend uses): one RoCE device whose
"hardware" moves bytes between processes of this host with process_vm_readv/writev. Registered regions and
connected queue pairs are files under $EMULATED_VERBS_DIR, so a transfer succeeds only when the owner still
registers the rkey's region and its queue pair is connected to the reader's."""
