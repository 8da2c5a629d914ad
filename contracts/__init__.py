"""The shared layer: what more than one service needs, and nothing that belongs to one.

Every service package may import it; it imports none of them (tests/test_layers.py checks),
and no torch, so the scheduler process stays torch-free.

    sampling_params  SamplingParams (a request's knobs) and RequestLimits (a server's caps)
    step             the messages of one engine step, scheduler <-> model service
    step_convert     the step's wire form (picovllm.model.v1), used by both ends of the call
    model_info       what the model service says about itself (GetInfo), and its wire form
    tokenizer        load_tokenizer: a model directory's tokenizer, without torch
    errors           domain errors and the interceptor that maps them to gRPC status codes
    rpc              the gRPC servers' start-up, signals, and the internal clients' retry loop
    health           grpc.health.v1 from the client side: check_health, check
    auth             secrets (from the environment or files) and the internal-token check
    service_config   the YAML config, one section per service
    phase_times      wall time per phase of a step, for benchmarks
"""
