"""Synthetic-data tasks: Redis, llama.cpp, vLLM, transformers/PEFT, ONNX, Python environments.

See :mod:`hivetune.data.synth_topics` for the template format and the answer convention.
"""

from __future__ import annotations

from hivetune.data.synth_topics import (GGUF_FILES, HF_MODELS, HOSTS, PROMPTS, SMALL_HF_MODELS,
                                        USERS, task)

_REDIS_POLICIES = (
    {"policy": "allkeys-lru", "use": "an LRU cache", "effect": "evicts the least recently used keys"},
    {"policy": "allkeys-lfu", "use": "a cache with hot keys", "effect": "evicts the least frequently used keys"},
    {"policy": "volatile-lru", "use": "a cache that only drops keys with a TTL",
     "effect": "evicts only keys with an expiry, least recently used first"},
    {"policy": "noeviction", "use": "a store that must never drop data",
     "effect": "rejects writes with an error once the limit is reached"},
)

REDIS = [
    task("redis.ping",
         goals=("check that the Redis server at {host} port {port} is up", "test the connection to Redis on {host} port {port}"),
         answers="$ redis-cli -h {host} -p {port} ping\nA healthy server answers PONG. If a "
                 "password is set, export REDISCLI_AUTH first instead of passing -a, which shows "
                 "up in the process list. NOAUTH Authentication required means it is missing.",
         command="redis-cli -h {host} -p {port} ping",
         slots={"host": HOSTS, "port": ("6379", "6380")}),
    task("redis.noauth",
         goals=("connect redis-cli to a Redis server on {host} that needs a password",),
         questions=(("redis-cli to {host} returns this error. What am I missing?",
                     "(error) NOAUTH Authentication required."),),
         answers="The server requires a password. Let redis-cli prompt for it, so it stays out of "
                 "your shell history and the process list:\n$ redis-cli -h {host} --askpass ping\n"
                 "For scripts, export REDISCLI_AUTH with the password instead. With ACL users add "
                 "--user NAME.",
         command="redis-cli -h {host} --askpass ping",
         slots={"host": HOSTS}),
    task("redis.memory",
         goals=("see how much memory Redis is using", "find out why Redis uses more RAM than expected"),
         answers="$ redis-cli info memory\nused_memory_human is the data plus overhead, "
                 "used_memory_rss_human what the OS sees; a large gap (mem_fragmentation_ratio) "
                 "means fragmentation. To find the biggest keys:\n$ redis-cli --bigkeys",
         command="redis-cli info memory"),
    task("redis.maxmemory",
         goals=("limit Redis to {mem} and use it as {use}", "set maxmemory {mem} with the {policy} policy in Redis"),
         answers="$ redis-cli config set maxmemory {mem}\n$ redis-cli config set maxmemory-policy {policy}\n"
                 "Both apply immediately; {policy} {effect}. Write them to redis.conf so they "
                 "survive a restart:\n$ redis-cli config rewrite",
         command="redis-cli config set maxmemory {mem}",
         slots={"mem": ("256mb", "1gb", "2gb", "4gb"), "p": _REDIS_POLICIES}),
    task("redis.aof",
         goals=("turn on append-only persistence in Redis", "make Redis lose at most about a second of writes"),
         answers="$ redis-cli config set appendonly yes\n$ redis-cli config rewrite\nThe AOF "
                 "logs every write and by default fsyncs once per second (appendfsync everysec), "
                 "so a crash loses about a second at most. RDB snapshots can stay on as well.",
         command="redis-cli config set appendonly yes"),
    task("redis.bgsave",
         goals=("take a consistent Redis snapshot for a backup", "back up the Redis dump.rdb safely"),
         answers="$ redis-cli bgsave\n$ redis-cli lastsave\nBGSAVE forks and writes dump.rdb in the "
                 "background; when the LASTSAVE timestamp changes, the file is complete. Find "
                 "its directory with redis-cli config get dir and copy dump.rdb elsewhere.",
         command="redis-cli bgsave"),
    task("redis.container",
         goals=("run Redis {ver} as the podman container {name} on port {port} with persistent data",
                "start a Redis {ver} container named {name} on port {port}"),
         answers="$ podman volume create redis-data\n"
                 "$ podman run -d --name {name} -p {port}:6379 -v redis-data:/data "
                 "docker.io/library/redis:{ver} redis-server --appendonly yes\n"
                 "$ podman exec -it {name} redis-cli ping\nThe official image keeps its data in /data.",
         command="podman run -d --name {name} -p {port}:6379 -v redis-data:/data docker.io/library/redis:{ver} "
                 "redis-server --appendonly yes",
         slots={"ver": ("7", "7.2", "7.4"), "name": ("redis", "cache", "queue"), "port": ("6379", "6380")}),
    task("redis.slowlog",
         goals=("find slow commands in Redis by listing the last {n} slowlog entries",
                "show the last {n} slow queries that Redis logged"),
         answers="$ redis-cli slowlog get {n}\nlists the {n} most recent commands slower than "
                 "slowlog-log-slower-than (10000 microseconds by default) with their duration and "
                 "arguments. Measure client-side latency with redis-cli --latency.",
         command="redis-cli slowlog get {n}",
         slots={"n": ("10", "25", "50")}),
    task("redis.scan",
         goals=("list the keys matching {pattern} without blocking Redis", "count the Redis keys that match {pattern}"),
         answers="$ redis-cli --scan --pattern '{pattern}'\nSCAN walks the keyspace in small "
                 "batches, unlike KEYS, which blocks the server until it is done. Count the "
                 "matches by piping to wc -l.",
         command="redis-cli --scan --pattern '{pattern}'",
         slots={"pattern": ("session:*", "user:*", "cache:*", "job:*")}),
    task("redis.acl",
         goals=("create the Redis user {user} with password {pw} that can only read keys starting with {prefix}:",
                "add a read-only Redis ACL user {user} with the password {pw} for the {prefix} keys"),
         answers="$ redis-cli ACL SETUSER {user} on '>{pw}' '~{prefix}:*' +@read\non enables the "
                 "user, >password sets its password, ~pattern limits the keys and +@read allows "
                 "read commands only. Persist it with ACL SAVE (aclfile) or CONFIG REWRITE, then test:\n"
                 "$ redis-cli --user {user} --pass '{pw}' get {prefix}:1",
         command="redis-cli ACL SETUSER {user} on '>{pw}' '~{prefix}:*' +@read",
         slots={"user": USERS, "prefix": ("app", "cache", "metrics"), "pw": ("change-me-123", "s3cret-Pass")}),
    task("redis.overcommit",
         goals=("fix the memory overcommit warning that Redis prints at startup",),
         questions=(("Redis logs this warning at startup. How do I fix it?",
                     "WARNING Memory overcommit must be enabled! Without it, a background save or "
                     "replication may fail under low memory condition."),),
         answers="Redis forks for BGSAVE and AOF rewrites, and with strict overcommit the fork can "
                 "fail. Enable overcommit:\n"
                 "$ echo 'vm.overcommit_memory = 1' | sudo tee /etc/sysctl.d/99-redis.conf\n"
                 "$ sudo sysctl --system\nRestart Redis and the warning is gone.",
         command="echo 'vm.overcommit_memory = 1' | sudo tee /etc/sysctl.d/99-redis.conf"),
    task("redis.ttl",
         goals=("make the Redis key {key} expire after {secs} seconds", "set a time to live of {secs} seconds on {key} in Redis"),
         answers="$ redis-cli expire {key} {secs}\n$ redis-cli ttl {key}\nTTL returns the remaining "
                 "seconds, -1 if the key has no expiry and -2 if it does not exist. To set a value "
                 "and its expiry together use SET {key} value EX {secs}.",
         command="redis-cli expire {key} {secs}",
         slots={"key": ("session:42", "cache:home", "token:abc"), "secs": ("60", "3600", "86400")}),
]

_PORTS = ("8080", "8081", "9000", "8012")
_QUANTS = ({"q": "Q4_K_M", "ql": "q4_k_m", "desc": "a good balance of size and quality"},
           {"q": "Q5_K_M", "ql": "q5_k_m", "desc": "a bit more quality for a bit more size"},
           {"q": "Q8_0", "ql": "q8_0", "desc": "near-lossless quality at about half the F16 size"})
_BASES = ("qwen2.5-7b-instruct", "llama-3.1-8b-instruct", "mistral-7b-instruct")
_BACKENDS = (
    {"flag": "-DGGML_CUDA=ON", "gpu": "an NVIDIA GPU", "note": "This needs the CUDA toolkit (nvcc)."},
    {"flag": "-DGGML_HIP=ON -DAMDGPU_TARGETS=gfx1100", "gpu": "an AMD RDNA3 GPU",
     "note": "This needs the ROCm HIP SDK; set AMDGPU_TARGETS to the gfx name from rocminfo. If "
             "CMake cannot find the HIP compiler, prefix the configure step with "
             "HIPCXX=\"$(hipconfig -l)/clang\"."},
    {"flag": "-DGGML_VULKAN=ON", "gpu": "any GPU through Vulkan",
     "note": "This needs the Vulkan headers, loader and glslc."},
)
_HF_GGUF = ("ggml-org/gemma-3-1b-it-GGUF", "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M",
            "unsloth/Qwen3-8B-GGUF:Q4_K_M")
_PARALLEL = ({"np": "2", "total": "8192", "per": "4096"}, {"np": "4", "total": "16384", "per": "4096"},
             {"np": "8", "total": "32768", "per": "4096"})

LLAMA_CPP = [
    task("llama_cpp.serve",
         goals=("serve {gguf} with llama-server on port {port} using the GPU",
                "start an OpenAI-compatible server for {gguf} on port {port} with llama.cpp"),
         answers=("$ llama-server -m {gguf} --port {port} -ngl 99 -c {ctx}\n-ngl 99 offloads "
                  "all layers to the GPU (lower it if VRAM runs out) and -c sets the context size. "
                  "It listens on 127.0.0.1; add --host 0.0.0.0 to reach it from other machines. "
                  "There is a web UI at http://localhost:{port} and an OpenAI-compatible API under /v1.",
                  "1. Start the server with all layers on the GPU:\n"
                  "$ llama-server -m {gguf} --port {port} -ngl 99 -c {ctx}\n"
                  "2. Check that the model is loaded:\n$ curl http://localhost:{port}/health\n"
                  "3. Point OpenAI clients at http://localhost:{port}/v1."),
         command="llama-server -m {gguf} --port {port} -ngl 99",
         slots={"gguf": GGUF_FILES, "port": _PORTS, "ctx": ("4096", "8192", "16384")}),
    task("llama_cpp.curl",
         goals=("send a chat request to llama-server on port {port} with curl", "test the OpenAI API of llama-server on port {port} from the shell"),
         answers="$ curl http://localhost:{port}/v1/chat/completions -H \"Content-Type: application/json\" "
                 "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"{prompt}\"}], \"max_tokens\": {maxtok}}'\n"
                 "The reply follows the OpenAI format; the text is in choices[0].message.content. "
                 "GET /health reports whether the model is loaded.",
         command="curl http://localhost:{port}/v1/chat/completions",
         slots={"port": _PORTS, "prompt": PROMPTS, "maxtok": ("64", "128", "256")}),
    task("llama_cpp.quantize",
         goals=("quantize {base}-f16.gguf to {q} with llama.cpp", "make a {q} version of my F16 GGUF model {base}"),
         answers="$ llama-quantize {base}-f16.gguf {base}-{ql}.gguf {q}\n{q} gives {desc}. Start "
                 "from an F16 or BF16 GGUF, never from an already quantized file. For very low-bit "
                 "types an importance matrix (--imatrix) improves quality.",
         command="llama-quantize {base}-f16.gguf {base}-{ql}.gguf {q}",
         slots={"base": _BASES, "quant": _QUANTS}),
    task("llama_cpp.convert",
         goals=("convert the Hugging Face model in {hfdir} to a {outtype} GGUF file", "turn my fine-tuned model in {hfdir} into a {outtype} GGUF file"),
         answers="From a llama.cpp checkout with its Python requirements installed:\n"
                 "$ python convert_hf_to_gguf.py {hfdir} --outfile {out}-{outtype}.gguf --outtype {outtype}\n"
                 "Quantize the result further with llama-quantize. Merge LoRA adapters into the "
                 "base weights before converting.",
         command="python convert_hf_to_gguf.py {hfdir} --outfile {out}-{outtype}.gguf --outtype {outtype}",
         slots={"src": ({"hfdir": "./Qwen2.5-7B-Instruct", "out": "qwen2.5-7b-instruct"},
                        {"hfdir": "~/models/Llama-3.2-3B-Instruct", "out": "llama-3.2-3b-instruct"},
                        {"hfdir": "./my-finetuned-model", "out": "my-finetuned-model"}),
                "outtype": ("f16", "bf16", "q8_0")}),
    task("llama_cpp.build",
         goals=("build llama.cpp from source for {gpu}", "compile llama.cpp with GPU support for {gpu}"),
         answers="$ git clone https://github.com/ggml-org/llama.cpp\n$ cd llama.cpp\n"
                 "$ cmake -B build {flag}\n$ cmake --build build --config Release -j\n{note} "
                 "The binaries, including llama-server and llama-cli, end up in build/bin.",
         command="cmake -B build {flag}",
         slots={"backend": _BACKENDS}),
    task("llama_cpp.container",
         goals=("run llama-server for {gguf} in a podman container with an NVIDIA GPU on host port {port}",
                "serve {gguf} from a llama.cpp container published on port {port}"),
         answers="$ podman run --rm -p {port}:8080 -v /srv/models:/models:z --device nvidia.com/gpu=all "
                 "ghcr.io/ggml-org/llama.cpp:server-cuda -m /models/{gguf} --host 0.0.0.0 --port 8080 -ngl 99\n"
                 "Inside the container the server must listen on 0.0.0.0; the host reaches it at "
                 "localhost:{port}. The :z suffix relabels the model directory for SELinux.",
         command="podman run --rm -p {port}:8080 -v /srv/models:/models:z --device nvidia.com/gpu=all "
                 "ghcr.io/ggml-org/llama.cpp:server-cuda -m /models/{gguf} --host 0.0.0.0 --port 8080 -ngl 99",
         slots={"port": _PORTS, "gguf": GGUF_FILES}),
    task("llama_cpp.hf",
         goals=("let llama-server download {repo} from Hugging Face and serve it on port {port}",
                "serve {repo} on port {port} without downloading the GGUF by hand"),
         answers="$ llama-server -hf {repo} --port {port} -ngl 99\n-hf downloads the GGUF from "
                 "Hugging Face (a :QUANT suffix picks the quantization), caches it locally and "
                 "reuses it next time. Set HF_TOKEN for gated repositories.",
         command="llama-server -hf {repo} --port {port} -ngl 99",
         slots={"repo": _HF_GGUF, "port": _PORTS}),
    task("llama_cpp.oom",
         goals=("fit {gguf} into a GPU with too little VRAM for llama-server",),
         questions=(("llama-server crashes while loading {gguf} with this error. What can I do?",
                     "CUDA error: out of memory"),
                    "llama-server runs out of VRAM with {gguf}. Which options should I change?"),
         answers="The weights plus the KV cache don't fit in VRAM. Options:\n"
                 "1. Offload fewer layers; the rest runs on the CPU.\n"
                 "2. Shrink the context, which shrinks the KV cache.\n"
                 "$ llama-server -m {gguf} -ngl {ngl} -c 4096\n"
                 "3. Quantize the KV cache with -ctk q8_0 -ctv q8_0.\n"
                 "4. Use a smaller quantization of the model.",
         command="llama-server -m {gguf} -ngl {ngl} -c 4096",
         slots={"gguf": GGUF_FILES, "ngl": ("20",)}),
    task("llama_cpp.parallel",
         goals=("serve {np} requests in parallel from {gguf} with llama-server",
                "let {np} clients use one llama-server running {gguf} at the same time"),
         answers="$ llama-server -m {gguf} -ngl 99 -np {np} -c {total}\n-np creates {np} slots "
                 "that are decoded together with continuous batching. -c is the total context "
                 "shared by the slots, so plan about {per} tokens per request here.",
         command="llama-server -m {gguf} -ngl 99 -np {np} -c {total}",
         slots={"gguf": GGUF_FILES, "par": _PARALLEL}),
    task("llama_cpp.api_key",
         goals=("protect llama-server for {gguf} on port {port} with the API key {key}",
                "expose llama-server with {gguf} on port {port} to the network but require the key {key}"),
         answers="$ llama-server -m {gguf} --host 0.0.0.0 --port {port} --api-key {key}\n"
                 "Clients must send the header Authorization: Bearer {key}. Also open the port "
                 "only to trusted networks, for example with a firewalld rich rule.",
         command="llama-server -m {gguf} --host 0.0.0.0 --port {port} --api-key {key}",
         slots={"gguf": GGUF_FILES, "port": _PORTS, "key": ("sk-local-123", "team-secret", "changeme42")}),
    task("llama_cpp.bench",
         goals=("measure the tokens per second of {gguf} on my GPU",
                "benchmark the prompt processing and generation speed of {gguf} with llama.cpp"),
         answers="$ llama-bench -m {gguf} -ngl 99\nBy default it runs pp512 (prompt processing of "
                 "512 tokens) and tg128 (generating 128 tokens) and prints tokens per second for "
                 "each. Compare quantizations or -ngl values on the same machine.",
         command="llama-bench -m {gguf} -ngl 99",
         slots={"gguf": GGUF_FILES}),
]

_VLLM_PORTS = ("8000", "8001", "9000")
_KV_ERRORS = ({"maxlen": "131072", "kv": "46512", "len": "32768"},
              {"maxlen": "32768", "kv": "21904", "len": "16384"},
              {"maxlen": "131072", "kv": "18880", "len": "16384"})
_ADAPTERS = ({"name": "sql-adapter", "path": "/srv/adapters/sql"}, {"name": "support-bot", "path": "/srv/adapters/support"},
             {"name": "ops-lora", "path": "/srv/adapters/ops"})
_DTYPES = ({"gpu": "a Tesla T4", "dtype": "half"}, {"gpu": "a V100", "dtype": "half"},
           {"gpu": "an A100", "dtype": "bfloat16"}, {"gpu": "an L40S", "dtype": "bfloat16"})
# Models whose attention-head counts are divisible by 2, 4 and 8 (tensor parallelism needs it).
_TP_MODELS = ("meta-llama/Llama-3.1-8B-Instruct", "mistralai/Mistral-7B-Instruct-v0.3", "google/gemma-2-9b-it",
              "meta-llama/Llama-3.1-70B-Instruct", "Qwen/Qwen2.5-72B-Instruct")
_AWQ_MODELS = ("Qwen/Qwen2.5-7B-Instruct-AWQ", "TheBloke/Mistral-7B-Instruct-v0.2-AWQ",
               "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4")

VLLM = [
    task("vllm.serve",
         goals=("serve {model} with vLLM on port {port}", "start an OpenAI-compatible vLLM server for {model} on port {port}"),
         answers="$ vllm serve {model} --port {port}\nvLLM downloads the weights from Hugging Face "
                 "(set HF_TOKEN for gated models) and serves an OpenAI-compatible API at "
                 "http://localhost:{port}/v1. Check it with:\n$ curl http://localhost:{port}/v1/models",
         command="vllm serve {model} --port {port}",
         slots={"model": HF_MODELS, "port": _VLLM_PORTS}),
    task("vllm.tensor_parallel",
         goals=("split {model} across {n} GPUs with vLLM", "run {model} on {n} GPUs with tensor parallelism"),
         answers="$ vllm serve {model} --tensor-parallel-size {n}\nTensor parallelism shards every "
                 "layer across the {n} GPUs, which should have a fast interconnect such as NVLink. "
                 "The number of attention heads must be divisible by {n}.",
         command="vllm serve {model} --tensor-parallel-size {n}",
         slots={"model": _TP_MODELS, "n": ("2", "4", "8")}),
    task("vllm.memory",
         goals=("make vLLM use only {util} of the GPU memory for {model} with a {len}-token context",
                "run {model} in vLLM with a context of {len} tokens and a memory utilization of {util}"),
         answers="$ vllm serve {model} --gpu-memory-utilization {util} --max-model-len {len}\n"
                 "vLLM preallocates that fraction of VRAM (default 0.9) for weights and KV cache. "
                 "A shorter --max-model-len lowers the cache it must reserve per sequence, and "
                 "--max-num-seqs caps concurrent requests.",
         command="vllm serve {model} --gpu-memory-utilization {util} --max-model-len {len}",
         slots={"model": HF_MODELS, "util": ("0.8", "0.85", "0.7"), "len": ("4096", "8192", "16384")}),
    task("vllm.kv_error",
         goals=("fix the vLLM KV cache error for {model} by capping the context at {len} tokens",),
         questions=(("vllm serve {model} fails at startup with this error. I only need {len} tokens of context. "
                     "How do I fix it?",
                     "ValueError: The model's max seq len ({maxlen}) is larger than the maximum number "
                     "of tokens that can be stored in KV cache ({kv}). Try increasing "
                     "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."),),
         answers="The model's default context ({maxlen} tokens) needs more KV cache than fits next "
                 "to the weights. Limit the context:\n$ vllm serve {model} --max-model-len {len}\n"
                 "or give vLLM more of the GPU:\n$ vllm serve {model} --gpu-memory-utilization 0.95\n"
                 "More GPUs (--tensor-parallel-size) or a quantized model also help.",
         command="vllm serve {model} --max-model-len {len}",
         slots={"model": HF_MODELS, "e": _KV_ERRORS}),
    task("vllm.lora",
         goals=("serve the rank-{rank} LoRA adapter in {path} as {name} on top of {model} with vLLM",
                "load the adapter {name} from {path} into a vLLM server for {model}, max rank {rank}"),
         answers="$ vllm serve {model} --enable-lora --lora-modules {name}={path} --max-lora-rank {rank}\n"
                 "Requests with \"model\": \"{name}\" use the adapter, while the base model name "
                 "still works without it. --max-lora-rank must be at least the adapter's r.",
         command="vllm serve {model} --enable-lora --lora-modules {name}={path} --max-lora-rank {rank}",
         slots={"model": HF_MODELS, "adapter": _ADAPTERS, "rank": ("16", "32", "64")}),
    task("vllm.container",
         goals=("run vLLM for {model} in a podman container with NVIDIA GPUs",
                "serve {model} from the official vLLM container image"),
         answers="$ podman run --rm --device nvidia.com/gpu=all -p 8000:8000 --ipc=host "
                 "-v ~/.cache/huggingface:/root/.cache/huggingface:z -e HF_TOKEN "
                 "docker.io/vllm/vllm-openai:latest --model {model}\n--ipc=host gives PyTorch "
                 "enough shared memory and the volume reuses downloaded weights. Arguments after "
                 "the image go to the vLLM server.",
         command="podman run --rm --device nvidia.com/gpu=all -p 8000:8000 --ipc=host "
                 "-v ~/.cache/huggingface:/root/.cache/huggingface:z -e HF_TOKEN "
                 "docker.io/vllm/vllm-openai:latest --model {model}",
         slots={"model": HF_MODELS}),
    task("vllm.curl",
         goals=("query a vLLM server running {model} on port {port} with curl",
                "send a chat completion for {model} to vLLM on port {port}"),
         answers="$ curl http://localhost:{port}/v1/chat/completions -H \"Content-Type: application/json\" "
                 "-d '{\"model\": \"{model}\", \"messages\": [{\"role\": \"user\", \"content\": \"{prompt}\"}]}'\n"
                 "The model field must match the served name, which GET /v1/models lists "
                 "(see also --served-model-name).",
         command="curl http://localhost:{port}/v1/chat/completions",
         slots={"model": HF_MODELS, "port": _VLLM_PORTS, "prompt": PROMPTS}),
    task("vllm.dtype",
         goals=("choose the right dtype to serve {model} with vLLM on {gpu}",
                "run the bfloat16 model {model} with vLLM on {gpu}"),
         answers="$ vllm serve {model} --dtype {dtype}\n--dtype auto uses the model's dtype, but "
                 "GPUs older than Ampere (T4, V100) have no bfloat16 and need half. On {gpu} "
                 "use {dtype}.",
         command="vllm serve {model} --dtype {dtype}",
         slots={"model": HF_MODELS, "d": _DTYPES}),
    task("vllm.name_and_key",
         goals=("serve {model} under the short name {alias} with the API key {key}",
                "require the API key {key} for my vLLM server running {model} as {alias}"),
         answers="$ vllm serve {model} --served-model-name {alias} --api-key {key}\nClients then "
                 "send \"model\": \"{alias}\" and the header Authorization: Bearer {key}. Keep the "
                 "key out of shell history by reading it from an environment file.",
         command="vllm serve {model} --served-model-name {alias} --api-key {key}",
         slots={"model": HF_MODELS, "alias": ("chat", "assistant", "default"), "key": ("sk-local-123", "team-secret")}),
    task("vllm.awq",
         goals=("serve the AWQ-quantized model {qmodel} with vLLM", "run the 4-bit AWQ model {qmodel} in vLLM"),
         answers="$ vllm serve {qmodel} --quantization awq\nvLLM usually detects the method from the "
                 "model config, so the flag mainly documents intent. AWQ weights need about a third "
                 "of the FP16 memory, leaving more room for the KV cache.",
         command="vllm serve {qmodel} --quantization awq",
         slots={"qmodel": _AWQ_MODELS}),
    task("vllm.install",
         goals=("install vLLM in a virtual environment", "set up vLLM with pip on a CUDA machine"),
         answers="$ python3 -m venv ~/venvs/vllm\n$ source ~/venvs/vllm/bin/activate\n"
                 "$ pip install vllm\nThe wheel pulls a matching CUDA build of PyTorch, so use a "
                 "fresh environment. Check it with vllm --version.",
         command="pip install vllm"),
]

_RANKS = ({"r": "8", "alpha": "16"}, {"r": "16", "alpha": "32"}, {"r": "32", "alpha": "64"},
          {"r": "64", "alpha": "128"})
_OUTPUT_DIRS = ("./merged-model", "/srv/models/merged", "./out/final")
_ADAPTER_DIRS = ("./lora-adapter", "./runs/exp1/adapter", "/srv/adapters/support")
_ALL_MODELS = HF_MODELS + SMALL_HF_MODELS

TRANSFORMERS_PEFT = [
    task("transformers_peft.lora_config",
         goals=("wrap {model} with a LoRA adapter of rank {r} using PEFT", "add LoRA layers with r={r} to a causal language model"),
         answers=">>> from peft import LoraConfig, get_peft_model\n"
                 ">>> config = LoraConfig(r={r}, lora_alpha={alpha}, lora_dropout=0.05, "
                 "target_modules=[\"q_proj\", \"v_proj\"], task_type=\"CAUSAL_LM\")\n"
                 ">>> model = get_peft_model(model, config)\n>>> model.print_trainable_parameters()\n"
                 "Only the adapter weights train, usually well under 1% of the parameters; "
                 "lora_alpha / r scales the update.",
         command="config = LoraConfig(r={r}, lora_alpha={alpha}, lora_dropout=0.05, "
                 "target_modules=[\"q_proj\", \"v_proj\"], task_type=\"CAUSAL_LM\")",
         slots={"model": _ALL_MODELS, "rank": _RANKS}),
    task("transformers_peft.targets",
         goals=("choose target_modules for LoRA on a Llama-style model like {model}", "apply LoRA to every linear layer of {model}"),
         answers="Llama, Mistral and Qwen name their projections q_proj, k_proj, v_proj, o_proj "
                 "(attention) and gate_proj, up_proj, down_proj (MLP). Targeting all of them "
                 "usually beats attention-only at the same rank:\n"
                 ">>> config = LoraConfig(r=16, lora_alpha=32, target_modules=\"all-linear\", task_type=\"CAUSAL_LM\")\n"
                 "all-linear selects every linear layer except the output head.",
         command="config = LoraConfig(r=16, lora_alpha=32, target_modules=\"all-linear\", task_type=\"CAUSAL_LM\")",
         slots={"model": _ALL_MODELS}),
    task("transformers_peft.merge",
         goals=("merge the LoRA adapter in {adapter} into {model} and save the result",
                "turn my LoRA adapter into a standalone model in {out}"),
         answers=">>> base = AutoModelForCausalLM.from_pretrained(\"{model}\", torch_dtype=torch.bfloat16)\n"
                 ">>> model = PeftModel.from_pretrained(base, \"{adapter}\")\n"
                 ">>> merged = model.merge_and_unload()\n>>> merged.save_pretrained(\"{out}\")\n"
                 "Save the tokenizer to {out} as well. The merged model loads without PEFT and "
                 "can be converted to GGUF.",
         command="merged = model.merge_and_unload()",
         slots={"model": _ALL_MODELS, "adapter": _ADAPTER_DIRS, "out": _OUTPUT_DIRS}),
    task("transformers_peft.load_bf16",
         goals=("load {model} in bfloat16 across the available GPUs", "load {model} with transformers without running out of memory"),
         answers=">>> tokenizer = AutoTokenizer.from_pretrained(\"{model}\")\n"
                 ">>> model = AutoModelForCausalLM.from_pretrained(\"{model}\", torch_dtype=torch.bfloat16, device_map=\"auto\")\n"
                 "device_map=\"auto\" needs the accelerate package and fills the GPUs first, then "
                 "CPU memory. bfloat16 halves the memory compared with float32.",
         command="model = AutoModelForCausalLM.from_pretrained(\"{model}\", torch_dtype=torch.bfloat16, device_map=\"auto\")",
         slots={"model": _ALL_MODELS}),
    task("transformers_peft.qlora",
         goals=("set up QLoRA fine-tuning for {model} in 4 bits", "fine-tune {model} with a 4-bit base model and LoRA"),
         answers=">>> bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", "
                 "bnb_4bit_compute_dtype=torch.bfloat16)\n"
                 ">>> model = AutoModelForCausalLM.from_pretrained(\"{model}\", quantization_config=bnb, device_map=\"auto\")\n"
                 ">>> model = prepare_model_for_kbit_training(model)\n"
                 ">>> model = get_peft_model(model, LoraConfig(r={r}, lora_alpha={alpha}, "
                 "target_modules=\"all-linear\", task_type=\"CAUSAL_LM\"))\nThis needs bitsandbytes and a supported GPU.",
         command="model = prepare_model_for_kbit_training(model)",
         slots={"model": HF_MODELS, "rank": _RANKS}),
    task("transformers_peft.chat_template",
         goals=("format a conversation with the chat template of {model}", "build a prompt for {model} that the model expects"),
         answers=">>> messages = [{\"role\": \"user\", \"content\": \"{prompt}\"}]\n"
                 ">>> text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)\n"
                 "add_generation_prompt=True appends the assistant header so the model answers "
                 "instead of continuing the user turn. Use the same template for training and inference.",
         command="text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)",
         slots={"model": _ALL_MODELS, "prompt": PROMPTS}),
    task("transformers_peft.download",
         goals=("download {model} to {dir} ahead of time", "fetch the weights of {model} into {dir} for offline use"),
         answers="$ huggingface-cli download {model} --local-dir {dir}\nLog in first with "
                 "huggingface-cli login, or set HF_TOKEN, for gated models such as Llama. Newer "
                 "huggingface_hub releases also offer the shorter hf download. Load it with "
                 "from_pretrained(\"{dir}\").",
         command="huggingface-cli download {model} --local-dir {dir}",
         slots={"model": _ALL_MODELS, "dir": ("/srv/models/base", "./models/base", "/data/hf/base")}),
    task("transformers_peft.cache",
         goals=("move the Hugging Face cache to {path}",
                "stop Hugging Face downloads from filling my home directory by using {path}"),
         answers="$ export HF_HOME={path}\nPut it in ~/.bashrc, or Environment=HF_HOME={path} in a "
                 "service. Models then land in {path}/hub. huggingface-cli scan-cache shows what "
                 "uses space and huggingface-cli delete-cache removes entries interactively.",
         command="export HF_HOME={path}",
         slots={"path": ("/srv/hf-cache", "/data/huggingface", "/mnt/nvme/hf")}),
    task("transformers_peft.generate",
         goals=("generate text from a transformers model with at most {n} new tokens", "run greedy generation with {model} for up to {n} new tokens"),
         answers=">>> inputs = tokenizer(\"{prompt}\", return_tensors=\"pt\").to(model.device)\n"
                 ">>> out = model.generate(**inputs, max_new_tokens={n}, do_sample=False)\n"
                 ">>> print(tokenizer.decode(out[0][inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True))\n"
                 "Slicing off the prompt prints only the new text; do_sample=False means greedy decoding.",
         command="out = model.generate(**inputs, max_new_tokens={n}, do_sample=False)",
         slots={"model": _ALL_MODELS, "prompt": PROMPTS, "n": ("64", "128", "256")}),
    task("transformers_peft.save_adapter",
         goals=("save only the LoRA adapter to {out} after training", "store my trained PEFT adapter in {out} without the base weights"),
         answers=">>> model.save_pretrained(\"{out}\")\nOn a PEFT model this writes only "
                 "adapter_config.json and adapter_model.safetensors, a few megabytes. Load it later "
                 "with PeftModel.from_pretrained(base, \"{out}\"), or merge it into the base "
                 "weights with merge_and_unload() when you need a standalone model.",
         command="model.save_pretrained(\"{out}\")",
         slots={"out": _ADAPTER_DIRS}),
    task("transformers_peft.grad_ckpt",
         goals=("reduce activation memory while fine-tuning {model} with LoRA", "turn on gradient checkpointing for a PEFT model"),
         answers=">>> model.gradient_checkpointing_enable()\n>>> model.enable_input_require_grads()\n"
                 "Checkpointing recomputes activations during the backward pass, trading some speed "
                 "for much less memory. enable_input_require_grads keeps gradients flowing when the "
                 "base model is frozen, as it is with LoRA.",
         command="model.gradient_checkpointing_enable()",
         slots={"model": _ALL_MODELS}),
]

_ONNX_FILES = ("model.onnx", "encoder.onnx", "classifier.onnx", "resnet50.onnx")
_EXPORT_MODELS = ({"model": "distilbert-base-uncased", "out": "distilbert_onnx"},
                  {"model": "gpt2", "out": "gpt2_onnx"},
                  {"model": "sentence-transformers/all-MiniLM-L6-v2", "out": "minilm_onnx"},
                  {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "out": "smollm2_onnx"})

ONNX = [
    task("onnx.optimum_export",
         goals=("export {model} to ONNX with Optimum", "convert the Hugging Face model {model} to ONNX format"),
         answers="With Optimum and its ONNX exporter installed:\n$ optimum-cli export onnx --model {model} {out}/\n"
                 "Optimum infers the task; pass --task (for example text-generation-with-past) if "
                 "it guesses wrong. The folder holds model.onnx plus the tokenizer files.",
         command="optimum-cli export onnx --model {model} {out}/",
         slots={"m": _EXPORT_MODELS},
         brief="$ optimum-cli export onnx --model {model} {out}/\n"
               "Optimum infers the task; pass --task (for example text-generation-with-past) if it guesses wrong."),
    task("onnx.gpu_session",
         goals=("run {file} with ONNX Runtime on the GPU", "create an ONNX Runtime session for {file} with CUDA"),
         answers=">>> import onnxruntime as ort\n"
                 ">>> sess = ort.InferenceSession(\"{file}\", providers=[\"CUDAExecutionProvider\", \"CPUExecutionProvider\"])\n"
                 ">>> outputs = sess.run(None, {\"input\": x})\nProviders are tried in order, so "
                 "it falls back to the CPU; sess.get_providers() shows which are active. CUDA needs "
                 "the onnxruntime-gpu package.",
         command="sess = ort.InferenceSession(\"{file}\", providers=[\"CUDAExecutionProvider\", \"CPUExecutionProvider\"])",
         slots={"file": _ONNX_FILES}),
    task("onnx.providers",
         goals=("check which execution providers my onnxruntime install supports", "find out whether onnxruntime can use my GPU"),
         answers="$ python -c \"import onnxruntime as ort; print(ort.get_available_providers())\"\n"
                 "The CPU-only onnxruntime package lists just CPUExecutionProvider; install "
                 "onnxruntime-gpu for CUDA. Don't install both packages in one environment, they conflict.",
         command="python -c \"import onnxruntime as ort; print(ort.get_available_providers())\""),
    task("onnx.check",
         goals=("validate that {file} is a well-formed ONNX model", "check {file} for structural errors"),
         answers="$ python -c \"import onnx; onnx.checker.check_model(onnx.load('{file}'))\"\n"
                 "No output means the graph passed. For models over 2 GB pass the path instead: "
                 "onnx.checker.check_model('{file}'). onnx.load('{file}').opset_import shows the opset.",
         command="python -c \"import onnx; onnx.checker.check_model(onnx.load('{file}'))\"",
         slots={"file": _ONNX_FILES}),
    task("onnx.torch_export",
         goals=("export a PyTorch model to {file} with a dynamic batch size and opset {opset}",
                "save my PyTorch network as {file} for ONNX Runtime using opset {opset}"),
         answers=">>> model.eval()\n>>> torch.onnx.export(model, dummy_input, \"{file}\", "
                 "input_names=[\"input\"], output_names=[\"output\"], dynamic_axes={\"input\": {0: \"batch\"}, "
                 "\"output\": {0: \"batch\"}}, opset_version={opset})\ndummy_input needs the right shape and "
                 "dtype; dynamic_axes lets the batch size vary at inference time.",
         command="torch.onnx.export(model, dummy_input, \"{file}\", input_names=[\"input\"], "
                 "output_names=[\"output\"], dynamic_axes={\"input\": {0: \"batch\"}, "
                 "\"output\": {0: \"batch\"}}, opset_version={opset})",
         slots={"file": _ONNX_FILES, "opset": ("17", "18")}),
    task("onnx.quantize",
         goals=("shrink {file} into {out} with dynamic INT8 quantization",
                "quantize the weights of {file} to 8 bits and save the result as {out}"),
         answers=">>> from onnxruntime.quantization import quantize_dynamic, QuantType\n"
                 ">>> quantize_dynamic(\"{file}\", \"{out}\", weight_type=QuantType.QInt8)\nWeights "
                 "are stored as int8, about 4x smaller than float32, and activations are quantized "
                 "on the fly. It suits transformer models on the CPU; check accuracy afterwards.",
         command="quantize_dynamic(\"{file}\", \"{out}\", weight_type=QuantType.QInt8)",
         slots={"file": _ONNX_FILES, "out": ("model.int8.onnx", "quantized.onnx")}),
    task("onnx.inputs",
         goals=("print the input names and shapes of {file}", "find out what inputs the ONNX model {file} expects"),
         answers=">>> sess = ort.InferenceSession(\"{file}\", providers=[\"CPUExecutionProvider\"])\n"
                 ">>> [(i.name, i.shape, i.type) for i in sess.get_inputs()]\nSymbolic dimensions "
                 "show up as strings such as 'batch'. sess.get_outputs() does the same for outputs.",
         command="[(i.name, i.shape, i.type) for i in sess.get_inputs()]",
         slots={"file": _ONNX_FILES}),
    task("onnx.threads",
         goals=("limit ONNX Runtime to {n} CPU threads", "stop onnxruntime from using every CPU core; {n} threads are enough"),
         answers=">>> so = ort.SessionOptions()\n>>> so.intra_op_num_threads = {n}\n"
                 ">>> sess = ort.InferenceSession(\"{file}\", so, providers=[\"CPUExecutionProvider\"])\n"
                 "intra_op threads parallelize single operators; inter_op_num_threads only matters "
                 "in parallel execution mode.",
         command="so.intra_op_num_threads = {n}",
         slots={"n": ("1", "2", "4", "8"), "file": _ONNX_FILES}),
    task("onnx.simplify",
         goals=("simplify the graph of {file} into {out} before deployment",
                "fold constants and remove redundant nodes in {file}, writing {out}"),
         answers="$ pip install onnxsim\n$ onnxsim {file} {out}\nonnx-simplifier folds constants and "
                 "removes redundant operators; it prints a before/after table of node counts. "
                 "Validate the output against the original on real inputs.",
         command="onnxsim {file} {out}",
         slots={"file": _ONNX_FILES, "out": ("model.sim.onnx", "simplified.onnx")}),
]

_VENV_DIRS = (".venv", "~/venvs/llm", "/opt/app/venv")
_TORCH_BUILDS = ({"idx": "cu124", "what": "CUDA 12.4"}, {"idx": "cu121", "what": "CUDA 12.1"},
                 {"idx": "rocm6.2", "what": "ROCm 6.2"}, {"idx": "cpu", "what": "CPU-only"})
_MISSING_MODULES = ({"mod": "yaml", "pkg": "pyyaml"}, {"mod": "cv2", "pkg": "opencv-python"},
                    {"mod": "sklearn", "pkg": "scikit-learn"}, {"mod": "transformers", "pkg": "transformers"})

PYTHON_ENV = [
    task("python_env.venv",
         goals=("create a virtual environment in {dir} and install requirements.txt", "set up an isolated Python environment in {dir}"),
         questions=(("pip install fails inside my Debian-based container with this error. I'd like a venv in {dir}. "
                     "What should I do?",
                     "error: externally-managed-environment"),),
         answers="$ python3 -m venv {dir}\n$ source {dir}/bin/activate\n$ pip install -r requirements.txt\n"
                 "After activation python and pip refer to the environment; deactivate leaves it. "
                 "Don't sudo pip install into the system Python: it can break dnf-managed packages.",
         command="python3 -m venv {dir}",
         slots={"dir": _VENV_DIRS}),
    task("python_env.uv",
         goals=("create a Python {ver} environment with uv and add {pkg}", "use uv to set up a fast Python {ver} virtual environment"),
         answers="$ uv venv --python {ver}\n$ source .venv/bin/activate\n$ uv pip install {pkg}\n"
                 "uv downloads the requested Python if it is missing and installs packages much "
                 "faster than pip. In a uv project, uv add {pkg} also records it in pyproject.toml.",
         command="uv venv --python {ver}",
         slots={"ver": ("3.11", "3.12"), "pkg": ("torch", "transformers", "numpy", "fastapi")}),
    task("python_env.torch_index",
         goals=("install the {what} build of PyTorch with pip", "get a {what} PyTorch wheel instead of the default one"),
         answers="$ pip install torch --index-url https://download.pytorch.org/whl/{idx}\nThe default "
                 "PyPI wheel on Linux is a CUDA build, so the index URL is how you pick ROCm, "
                 "CPU-only or another CUDA version. Check it afterwards:\n"
                 "$ python -c \"import torch; print(torch.__version__, torch.cuda.is_available())\"",
         command="pip install torch --index-url https://download.pytorch.org/whl/{idx}",
         slots={"b": _TORCH_BUILDS}),
    task("python_env.freeze",
         goals=("record the exact package versions of my environment", "save a requirements file of what is installed"),
         answers="$ pip freeze > requirements.txt\nReinstall the same set elsewhere with "
                 "pip install -r requirements.txt. pip check confirms that the installed packages "
                 "have compatible dependencies. Note the Python version too (python --version): "
                 "wheels differ between versions.",
         command="pip freeze > requirements.txt"),
    task("python_env.toolbox",
         goals=("get a mutable development environment called {name} on {atomic}",
                "install compilers in a toolbox named {name} without layering them on {atomic}"),
         answers="$ toolbox create {name}\n$ toolbox enter {name}\nThe toolbox is a Fedora "
                 "container that shares your home directory, so you can dnf install gcc and "
                 "python3-devel inside without touching the host. Leave it with exit.",
         command="toolbox create {name}",
         slots={"name": ("dev", "ml", "py312"), "atomic": ("Fedora Silverblue", "Fedora Kinoite", "a bootc host")}),
    task("python_env.pyenv",
         goals=("install Python {ver} with pyenv for one project", "use Python {ver} in a single project directory"),
         answers="$ pyenv install {ver}\n$ pyenv local {ver}\nlocal writes .python-version, so "
                 "the version applies in this directory only. pyenv builds from source; install the "
                 "headers first, e.g. sudo dnf install gcc make zlib-devel bzip2-devel "
                 "openssl-devel readline-devel sqlite-devel libffi-devel xz-devel tk-devel.",
         command="pyenv install {ver}",
         slots={"ver": ("3.10.14", "3.11.9", "3.12.4")}),
    task("python_env.pip_check",
         goals=("find broken or conflicting Python dependencies", "check my environment for incompatible package versions"),
         answers="$ pip check\nlists installed packages whose requirements are missing or have an "
                 "incompatible version. Fix them by upgrading or pinning the named packages, "
                 "ideally in a fresh virtual environment.",
         command="pip check"),
    task("python_env.kernel",
         goals=("use my virtual environment {dir} as a Jupyter kernel named {name}",
                "register the virtualenv {dir} as a kernel called {name} in Jupyter"),
         answers="$ source {dir}/bin/activate\n$ pip install ipykernel\n"
                 "$ python -m ipykernel install --user --name {name} --display-name \"Python ({name})\"\n"
                 "Restart JupyterLab and pick the kernel; jupyter kernelspec list shows all kernels.",
         command="python -m ipykernel install --user --name {name} --display-name \"Python ({name})\"",
         slots={"dir": _VENV_DIRS, "name": ("llm", "research", "py311")}),
    task("python_env.wrong_pip",
         goals=("make pip install {pkg} into the same Python that runs my code",),
         questions=(("pip installs {pkg}, but python still fails to import it. Why?",
                     "ModuleNotFoundError: No module named '{mod}'"),),
         answers="pip and python belong to different interpreters. Check:\n$ which python\n"
                 "$ python -m pip --version\nInstall through the interpreter you run, after "
                 "activating the right venv:\n$ python -m pip install {pkg}",
         command="python -m pip install {pkg}",
         slots={"m": _MISSING_MODULES}),
    task("python_env.cache",
         goals=("free the disk space used by the pip cache", "install a package without storing it in the pip cache"),
         answers="$ pip cache info\nshows where the cache is and how big it is.\n$ pip cache purge\n"
                 "empties it. For a single install without caching use "
                 "pip install --no-cache-dir PACKAGE, common in container builds.",
         command="pip cache purge"),
]

TASKS = REDIS + LLAMA_CPP + VLLM + TRANSFORMERS_PEFT + ONNX + PYTHON_ENV
