"""The router: the public scheduler API (picovllm.scheduler.v1) in front of several replicas,
each a scheduler + KV-cache + model group. It sends each request to the replica that holds
the longest cached prefix of its prompt (the replicas' prefix index in Redis), traded
against load, and retries a request that has not streamed yet elsewhere when its replica
fails. No torch here: it tokenizes with contracts.tokenizer and hashes with
contracts.block_hash, as the replicas do. docs/ROUTER.md has the design.
"""
