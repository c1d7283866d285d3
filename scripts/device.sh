#!/usr/bin/env bash
# Every GPU step of a stop, for the device machine (see /work/.library/device): install the carried
# wheels, then run the named steps in order, each under its own timeout, each logging to $OUT/<step>.log.
#
#   carry: .whl (made by scripts/device-wheels.sh; its `nvimgcodec` set for the GPU-decode steps of issue 18)    kind: nvidia-h200-x2 (TP and placement steps need both GPUs)
#   bash scripts/device.sh cuda-tests llm-tp2 serve-tp2 tp1-pair
#   bash scripts/device.sh tests-pair fused-ab llm-tp2      # issue 17's first check of the fused kernels
#   bash scripts/device.sh tests-pair attention-tests cuda-tp-tests fused-ab         # issue 17, call 1 of 2
#   bash scripts/device.sh llm-tp2 serve-tp1 serve-tp2 placement                     # issue 17, call 2 of 2
#   bash scripts/device.sh fused-ab llm-tp2 serve-pair-tp1 serve-tp2 placement       # issue 17, the final table
#   bash scripts/device.sh encoder-tests encode-load transfer encode-load-before   # issue 18's table (nvidia-h200)
#   bash scripts/device.sh encode-diag profile-graphed encode-graphs-ab ipc-probe  # issue 18, where the time goes
#   bash scripts/device.sh encoder-tests vision-bench encode-decode-ab   # issue 18, JPEGs decoded on the GPU
#   bash scripts/device.sh encoder-tests encode-load encode-ab   # issue 18, graph per batch size (.prev, .mid carried)
#   bash scripts/device.sh encode-replicas profile-graphed   # issue 18, sixth round: one service's process the cap?
#   (then whisper-replicas)
#   bash scripts/device.sh prefix-tests multiturn        # issue 22 (nvidia-h200), call 1 of 2
#   bash scripts/device.sh prefix-ab                     # issue 22, call 2 of 2: no sharing, on against off
#   bash scripts/device.sh video-cuda                    # issue 21's last CUDA test (device-wheels.sh video)
#   bash scripts/device.sh encoder-tests encode-load encode-final-ab   # the same round's table (.prev carried)
#   bash scripts/device.sh edge-ab                       # issue 17, the engine process: .prev = git archive a82fe1b
#   bash scripts/device.sh table-17                      # issue 17's table on one GPU (nvidia-h200)
#   bash scripts/device.sh profile-edge profile-placement   # issue 17: where the time goes now
#   bash scripts/device.sh prefill-17            # issue 17: the paged prefill kernel's tests and benches (one GPU)
#   bash scripts/device.sh table2-17 multiturn   # issue 17's table in one call; multi-turn TTFT (prefix chunks)
#   bash scripts/device.sh check-19              # issue 19: the GroupNorm fixes, the VAE with it, Whisper's stem
#   bash scripts/device.sh kernels-19            # issue 19: the new kernels' CUDA tests and their A/B, in ~250 s
#   bash scripts/device.sh groupnorm-19          # issue 19: the Triton GroupNorm's tests and what it buys the VAE
#   bash scripts/device.sh profile-19 table-19   # issue 19 (nvidia-h200), call 1: the towers' and VAE's kernels, the
#       table with HF compiled (default mode) beside ours; then vae-compiled-19 (call 2: diffusers compiled, NCHW and
#       channels-last), and vae-autotune-19, siglip-autotune-19 (max-autotune, a call each) if the table needs them
#   bash scripts/device.sh vae3-19               # issue 19: bias folds, upsample in the residual add, hd512 as GEMMs
#   bash scripts/device.sh vae-table-19          # issue 19: the VAE rows of the table (diffusers compiled beside)
#   bash scripts/device.sh towers-19             # issue 19: fa3 loading, add+LayerNorm, quick GELU, the GELU epilogue
#   bash scripts/device.sh towers-table-19       # issue 19's towers beside HF eager and compiled, the fixed tower tests
#   bash scripts/device.sh norms-check-19        # issue 19: the review mends' kernel tests on CUDA (~60 s)
#   bash scripts/device.sh profile-towers-19     # issue 19: where the towers' time goes after towers-19 (not run yet)
#   bash scripts/device.sh vae4-19               # issue 19: GroupNorm stats in the residual add, A/B (.prev); warm starts
#   bash scripts/device.sh vae5-19               # issue 19: the GroupNorm sweep; the VAE rows beside diffusers compiled
#   bash scripts/device.sh vae6-19               # issue 19: the CUDA tests again; the VAE rows beside diffusers compiled
#   bash scripts/device.sh profile-towers-19 ours-compiled-19   # where the towers' time goes; our VAE compiled
#   bash scripts/device.sh startup-19            # issue 19: starts with an empty and a filled --compile-cache
#   bash scripts/device.sh gemm-19 ours-compiled-19   # issue 19 (device-wheels.sh fa3): the towers' GEMMs against the
#       GPU's best cuBLAS rate, max-autotune on the costliest; our VAE decoder under torch.compile
#   bash scripts/device.sh vae7-19               # issue 19: VAE graphs, the GroupNorm passes alone, CUDA tests (~540 s)
#   bash scripts/device.sh vae8-19, then towers8-19   # issue 19's whole table in two calls on one warm machine
#   bash scripts/device.sh stop54-19, then stop54-vae-19   # issue 19's table after stop 54's changes, two calls
#   bash scripts/device.sh where-18              # issue 18: the transfer split by stage; image+text set-up, profiled
#   bash scripts/device.sh ab-18 transfer        # issue 18: forms compiled before serving; image+text A/B (.prev)
#   bash scripts/device.sh table3-17             # issue 17's table with the embeddings layout (LLM alone) beside shared
#   bash scripts/device.sh where-17              # issue 17: the embeddings layout's load with py-spy attached
#   bash scripts/device.sh frames-17             # issue 17: the link's frames and the GIL switch interval, A/B
#   bash scripts/device.sh post-17               # issue 17: M-RoPE kernel tests; .prev / .mid / this tree, three loads
#   bash scripts/device.sh short-17              # post-17 cut to about 300 s
#   bash scripts/device.sh graphs-17             # issue 17: image+text with the mixed graphs up to 1,024 / 2,048 / 4,096
#   bash scripts/device.sh budget2-17            # issue 17: long prompts at step budgets 512..8,192, mixed loads' controls
#   bash scripts/device.sh table4-17             # issue 17's table at the 1,024 budget, 256 streams at 8,192 beside
#   bash scripts/device.sh prefix-tests serve-once multiturn   # not run yet: the CUDA tests (prompt logprobs under
#       mixed graphs, the sampler's OpenAI fields, shared-page replay), the msgpack link at 256 streams, issue 22's TTFT
#
# Steps that need one GPU pin it with CUDA_VISIBLE_DEVICES; `tp1-pair` runs the two TP=1 benches at
# once, one on each GPU. A step that fails or times out is reported and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD"
# Never NVLink multicast on a shared host (KINDS.md); the machine sets these, a child keeps them.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/setup.log" 2>&1 || { echo "wheel install failed"; cat "$OUT/setup.log"; exit 1; }
# Everything a service and a bench import, so a wheel missing from .whl stops the call here, not each step.
python3 -c 'import torch, transformers, grpc, grpc_health.v1, grpc_reflection.v1alpha, soundfile, modalmesh.ops.launcher
print(torch.__version__, transformers.__version__, grpc.__version__, torch.cuda.device_count(), "GPUs")' \
    >>"$OUT/setup.log" 2>&1 || { echo "imports failed"; cat "$OUT/setup.log"; exit 1; }
cat "$OUT/setup.log"

step() {  # step NAME TIMEOUT COMMAND...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s"
    grep -E "^(RESULT|TP=|FAILED|ERROR)|passed|failed" "$OUT/$name.log" | tail -20
}

gpu_util_start() {  # nvidia-smi's utilisation every 200 ms into $OUT/gpu-util.log, until gpu_util_stop
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader -lms 200 >"$OUT/gpu-util.log" 2>&1 &
    SMI=$!
}
gpu_util_stop() { kill "$SMI"; }

profile_placement() {  # profile_placement NAME LAYOUT REQUESTS [LLM_ARGS]: bench/placement.py on GPU 0, py-spy attached once its
    # load runs (every process's threads, idle included, then who holds the GIL); $OUT/NAME-summary.txt and -prof.tgz
    local name=$1 log="$OUT/placement-$2-prof.log" P="$OUT/prof"
    mkdir -p "$P"
    env CUDA_VISIBLE_DEVICES=0 python3 bench/placement.py --layouts "$2" --requests "$3" --llm-args "${4:-}" >"$log" 2>&1 &
    local load=$!
    for _ in $(seq 300); do grep -q "load starts" "$log" 2>/dev/null && break; kill -0 "$load" || break; sleep 1; done
    sleep 3  # past the first wave's start
    timeout 60 /tmp/site/bin/py-spy record --pid "$load" --subprocesses --duration 6 --rate 100 --format raw \
        --threads --idle -o "$P/idle.txt" >"$P/py-spy.log" 2>&1
    timeout 60 /tmp/site/bin/py-spy record --pid "$load" --subprocesses --duration 5 --rate 100 --format raw \
        --threads --gil -o "$P/gil.txt" >>"$P/py-spy.log" 2>&1
    timeout 400 tail --pid "$load" -f /dev/null
    tail -34 "$log"
    python3 scripts/pyspy_summary.py "$P/idle.txt" "$P/gil.txt" --top 15 >"$OUT/$name-summary.txt" 2>&1
    tar czf "$OUT/$name-prof.tgz" -C "$OUT" prof && rm -rf "$P"
}

tower_tables() {  # issue 19's towers: ours, HF eager and HF under torch.compile (default mode, a cold inductor cache each)
    step vision-table 180 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vision.py \
        --only siglip-b32,qwen2vl-8x448,qwen25vl-8x448
    step audio-table 130 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/audio.py --batch 1 16 \
        --json "$OUT/audio-table.json"
}

on_tree() {  # on_tree DIR NAME LIMIT SCRIPT [ARGS...]: this tree's bench SCRIPT run on the code in DIR (an older
    # tree carried beside this one), with this tree's benches and their tiny checkpoints, so only the code differs
    local dir=$1 name=$2 limit=$3
    shift 3
    cp bench/*.py "$dir/bench/" && cp modalmesh/testing/tiny.py "$dir/modalmesh/testing/"
    step "$name" "$limit" bash -c 'cd "$0" && PYTHONPATH=/tmp/site:$PWD python3 "$@"' "$dir" "$@"
}

old_tree() {  # old_tree DIR NAME [ARGS...]: this tree's encode_load on the code in DIR (its towers not timed)
    local dir=$1 name=$2
    shift 2
    on_tree "$dir" "$name" 180 bench/encode_load.py --no-tower "$@"
}

for name in "$@"; do
    case $name in
        cuda-tests) step cuda-tests 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_llm_cuda.py ;;
        tests-pair)  # the fused kernels against the unfused path on GPU 0, the LLM's CUDA tests on GPU 1
            step kernel-tests 240 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider \
                tests/test_kernels.py &
            step cuda-tests 300 env CUDA_VISIBLE_DEVICES=1 python3 -m pytest -q -p no:cacheprovider \
                tests/test_llm_cuda.py -k "not tensor_parallel" &
            wait ;;
        attention-tests) step attention-tests 240 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider \
                tests/test_attention_backends.py -k cuda ;;
        fused-ab)  # the decode bench with (and the HF column) and without the fused kernels, one per GPU
            step llm-fused 300 env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,32,256 &
            step llm-unfused 240 env CUDA_VISIBLE_DEVICES=1 python3 bench/llm.py --batches 1,32,256 --no-hf \
                --no-fused-kernels &
            wait ;;
        cuda-tp-tests) step cuda-tp-tests 360 python3 -m pytest -q -p no:cacheprovider tests/test_llm_cuda.py \
                -k tensor_parallel ;;
        allreduce)
            nvidia-smi topo -m >"$OUT/topo.log" 2>&1
            step allreduce 120 env NCCL_DEBUG=INFO python3 bench/allreduce.py
            grep -E "via|Channel 00|NVLS|P2P|SHM" "$OUT/allreduce.log" | head -8
            cat "$OUT/topo.log" ;;
        llm-tp1) step llm-tp1 300 env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,256 ;;
        llm-tp2) step llm-tp2 300 python3 bench/llm.py --batches 1,256 --tp 2 ;;
        profile-llm) step profile-llm-tp2 240 python3 bench/llm.py --batches 1,256 --tp 2 --profile
                     step profile-llm-tp1 240 env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,256 \
                         --profile --no-hf ;;
        profile-llm1)  # TP=1 decode table (HF beside) and each batch's kernels by GPU time
            step profile-llm1 300 env PROFILE_ROWS=40 CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,32,256 \
                --profile ;;
        profile-serve-gil)  # 256 streams at TP=1: which thread holds the GIL (py-spy --gil), every process
            step profile-serve-gil 240 /tmp/site/bin/py-spy record --subprocesses --threads --gil --rate 100 \
                --format raw -o "$OUT/profile-serve-gil.txt" -- env CUDA_VISIBLE_DEVICES=0 python3 bench/serve.py \
                --start --tp 1 ;;
        kernel-tests) step kernel-tests 240 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider \
                tests/test_kernels.py tests/test_attention_backends.py ;;
        llm-ab)  # issue 17: decode on this tree (HF beside it) and on the code before (.prev: git archive REV)
            step llm-now 240 env PROFILE_ROWS=12 CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,32,256 --profile
            step llm-prev 150 bash -c 'cd .prev && PYTHONPATH=/tmp/site:$PWD CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py \
                --batches 1,32,256 --no-hf' ;;
        final-17)  # issue 17's closing call on one GPU: the CUDA tests, the table, serving with and without the freeze
            step cuda-tests 300 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -x -p no:cacheprovider tests/test_llm_cuda.py
            step llm-final 200 env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,32,256
            step serve-final 120 env CUDA_VISIBLE_DEVICES=0 python3 bench/serve.py --start --requests 1024
            step serve-final-nofreeze 120 env CUDA_VISIBLE_DEVICES=0 python3 bench/serve.py --start --requests 1024 \
                --llm-flag=--no-gc-freeze
            step serve-final-prev 120 bash -c 'cd .prev && PYTHONPATH=/tmp/site:$PWD CUDA_VISIBLE_DEVICES=0 python3 \
                bench/serve.py --start --requests 1024'
            step placement-shared 150 env CUDA_VISIBLE_DEVICES=0 python3 bench/placement.py --layouts shared ;;
        serve-long-ab)  # 4,096 requests each (the 1,024-request runs varied by +-15 %): this tree, without the gc
            # freeze, the code before (.prev), and this tree again
            step serve-long-now 150 env CUDA_VISIBLE_DEVICES=0 python3 bench/serve.py --start --requests 4096
            step serve-long-nofreeze 150 env CUDA_VISIBLE_DEVICES=0 python3 bench/serve.py --start --requests 4096 \
                --llm-flag=--no-gc-freeze
            step serve-long-prev 150 bash -c 'cd .prev && PYTHONPATH=/tmp/site:$PWD CUDA_VISIBLE_DEVICES=0 python3 \
                bench/serve.py --start --requests 4096'
            step serve-long-now2 150 env CUDA_VISIBLE_DEVICES=0 python3 bench/serve.py --start --requests 4096 ;;
        serve-tp1) step serve-tp1 300 env CUDA_VISIBLE_DEVICES=1 python3 bench/serve.py --start --tp 1 ;;
        serve-tp2) step serve-tp2 300 python3 bench/serve.py --start --tp 2 ;;
        cold-prefill)  # the first eager prefill after start-up, profiled, then the same batch warm
            step cold-prefill 240 /tmp/site/bin/py-spy record --rate 100 --format raw -o "$OUT/cold-prefill.txt" -- \
                env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 32,32,1 --no-hf --new-tokens 32 ;;
        cold-serve-pair)  # the cold-prefill profile on GPU 0 beside the TP=1 serving bench on GPU 1
            step cold-prefill 240 /tmp/site/bin/py-spy record --rate 100 --format raw -o "$OUT/cold-prefill.txt" -- \
                env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 32,32,1 --no-hf --new-tokens 32 &
            step serve-tp1 300 env CUDA_VISIBLE_DEVICES=1 python3 bench/serve.py --start --tp 1 &
            wait ;;
        serve-pair-tp1)  # the TP=1 serving bench on GPU 1 beside the LLM CUDA tests on GPU 0
            step serve-tp1 300 env CUDA_VISIBLE_DEVICES=1 python3 bench/serve.py --start --tp 1 &
            step cuda-tests 300 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider \
                tests/test_llm_cuda.py -k "not tensor_parallel" &
            wait ;;
        profile-serve-tp1) step profile-serve-tp1 300 /tmp/site/bin/py-spy record --subprocesses --rate 50 \
                --format raw -o "$OUT/profile-serve-tp1.txt" -- env CUDA_VISIBLE_DEVICES=0 python3 bench/serve.py \
                --start --tp 1 ;;
        placement) step placement 420 python3 bench/placement.py --layouts split,two-replicas ;;
        tp1-pair)  # the two TP=1 benches at once, one per GPU
            step llm-tp1 300 env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,256 &
            step serve-tp1 300 env CUDA_VISIBLE_DEVICES=1 python3 bench/serve.py --start --tp 1 &
            wait ;;
        profile-tp2) step profile-tp2 300 /tmp/site/bin/py-spy record --subprocesses --rate 50 --format raw \
                -o "$OUT/profile-tp2.txt" -- python3 bench/serve.py --start --tp 2 --requests 256 ;;
        encoder-tests) step encoder-tests 240 env MODALMESH_REQUIRE_NVIMGCODEC=1 python3 -m pytest -q -s -p no:cacheprovider \
                -k "cuda or device or graphs" tests/test_staging.py tests/test_codec.py tests/test_transfer.py \
                tests/test_transfer_cuda.py tests/test_vision_device_preprocess.py tests/test_device_decode.py \
                tests/test_device_decode_cuda.py tests/test_audio_device.py tests/test_audio_models.py \
                tests/test_vision_models.py tests/test_encoder_layer.py tests/test_batch_graphs.py
            grep -A12 "nvJPEG vs PIL\|nvJPEG + device" "$OUT/encoder-tests.log" | grep -v "^\.\|^$" | head -30 ;;
        encode-decode-ab)  # JPEGs decoded on the GPU (nvImageCodec) against PIL in the CPU threads, the same inputs
            gpu_util_start
            step encode-decode-ab 300 python3 bench/encode_load.py --only siglip,qwen2vl --no-tower \
                --variant nvjpeg= --variant "pil=--image-decode pil"
            gpu_util_stop
            grep "RESULT\|mean ms\|busiest" "$OUT/encode-decode-ab.log" ;;
        encode-load)  # the issue's table (towers and service), the GPU's utilisation sampled beside it
            gpu_util_start
            step encode-load 240 python3 bench/encode_load.py
            gpu_util_stop
            grep "mean ms\|busiest" "$OUT/encode-load.log" ;;
        encode-load-before)  # the same load on the code before issue 18 (.before: `git archive 8dcd57d`, carried)
            old_tree .before encode-load-before ;;
        encode-ab|encode-prev-ab)  # SigLIP and Whisper on this tree, then on each earlier tree carried (.mid,
            # .prev: `git archive REV`); encode-prev-ab was its name with .prev alone
            step encode-now 200 python3 bench/encode_load.py --only siglip,whisper --no-tower --requests 1024
            for dir in .mid .prev; do
                [ -d "$dir" ] && old_tree "$dir" "encode-${dir#.}" --only siglip,whisper --requests 1024
            done
            grep -h "mean ms\|img/s\|clip/s" "$OUT"/encode-*.log ;;
        encode-replicas)  # one service against two (and three) on the same GPU behind one round_robin target
            gpu_util_start
            step siglip-replicas 300 python3 bench/encode_load.py --only siglip --no-tower --requests 2048 \
                --variant one= --variant "two=@replicas=2" --variant "three=@replicas=3"
            gpu_util_stop
            grep -h "mean ms\|img/s\|batches, mean" "$OUT"/siglip-replicas.log ;;
        encode-final-ab)  # SigLIP (and Whisper) on this tree, SigLIP with a 0.5 ms GIL switch interval too,
            # then both on the code before (.prev: `git archive REV`, carried)
            step siglip-now 200 python3 bench/encode_load.py --only siglip --no-tower --requests 2048 \
                --variant default= --variant "si05=--switch-interval-ms 0.5"
            old_tree .prev siglip-prev --only siglip --requests 2048
            step whisper-now 150 python3 bench/encode_load.py --only whisper --no-tower --requests 1024
            old_tree .prev whisper-prev --only whisper --requests 1024
            grep -h "mean ms\|img/s\|clip/s\|batches, mean" "$OUT"/siglip-*.log "$OUT"/whisper-*.log ;;
        ipc-test) step ipc-test 120 python3 -m pytest -q -s -p no:cacheprovider tests/test_transfer_cuda.py -k "${IPC_K:-cuda}"
                  grep -h "batch running" "$OUT/ipc-test.log" ;;
        whisper-table)  # the table's Whisper row alone: the tower and the service in one run
            step whisper-table 200 python3 bench/encode_load.py --only whisper
            grep -h "mean ms\|clip/s\|batches, mean" "$OUT"/whisper-table.log ;;
        whisper-replicas)
            step whisper-replicas 200 python3 bench/encode_load.py --only whisper --no-tower --requests 768 \
                --variant one= --variant "two=@replicas=2"
            grep -h "mean ms\|clip/s\|batches, mean" "$OUT"/whisper-replicas.log ;;
        encode-graphs-ab)  # the towers replayed from CUDA graphs against --enforce-eager, the same inputs
            step encode-graphs-ab 200 python3 bench/encode_load.py --only siglip,whisper --no-tower \
                --variant graphs= --variant eager=--enforce-eager ;;
        encode-diag)  # where the time goes: per stage; cache hits (no model); embeddings to the CPU
            gpu_util_start
            step encode-diag 300 python3 bench/encode_load.py --only siglip,whisper --no-tower --variant default= \
                --variant "hits=@distinct=64" --variant "cpu=@cpu=1"
            gpu_util_stop
            grep "mean ms\|busiest" "$OUT/encode-diag.log" ;;
        siglip-diag)  # SigLIP with nvJPEG: embeddings to the client's GPU or to its CPU; 64 clients or 128
            gpu_util_start
            step siglip-diag 240 python3 bench/encode_load.py --only siglip --no-tower --variant gpu= \
                --variant "cpu=@cpu=1" --variant "bytes=--shared-memory-transfer off"
            step siglip-128 100 python3 bench/encode_load.py --only siglip --no-tower --clients 128
            gpu_util_stop
            grep -h "mean ms\|busiest\|img/s\|batches, mean" "$OUT/siglip-diag.log" "$OUT/siglip-128.log" ;;
        whisper-prev-ab)  # Whisper on this tree and on the code before (.prev: `git archive REV`, carried)
            step whisper-now 150 python3 bench/encode_load.py --only whisper
            old_tree .prev whisper-prev --only whisper
            grep -h "mean ms\|clip/s\|batches, mean\|busiest" "$OUT/whisper-now.log" "$OUT/whisper-prev.log" ;;
        vision-bench) step vision-bench 130 python3 bench/vision.py --only siglip-b32,qwen2vl-8x448 --no-hf ;;
        audio-bench) step audio-bench 150 python3 bench/audio.py --batch 1 16 --profile ;;
        transfer) step transfer 120 python3 bench/transfer.py --sizes 448,2688 ;;
        ipc-probe) step ipc-probe 60 python3 scripts/cuda_ipc_probe.py; cat "$OUT/ipc-probe.log" ;;
        profile-graphed|profile-whisper)  # a service under load (SigLIP, or Whisper): where each thread waits
            # (--idle), who holds the GIL (--gil)
            case_=siglip; module=services.vision_encoder; requests=4096
            [ "$name" = profile-whisper ] && { case_=whisper; module=services.audio_encoder; requests=2048; }
            P="$OUT/prof"; mkdir -p "$P"
            python3 bench/encode_load.py --only "$case_" --no-tower --requests "$requests" >"$P/load.log" 2>&1 &
            load=$!
            # (each wait ends early if the load has died)
            for _ in $(seq 120); do svc=$(pgrep -f "$module" | head -1); [ -n "$svc" ] && break; kill -0 "$load" || break
                                    sleep 1; done
            for _ in $(seq 150); do grep -q "load starts" "$P/load.log" 2>/dev/null && break; kill -0 "$load" || break
                                    sleep 1; done
            sleep 2  # past the warm-up calls
            # The load's own process (the client, as an LLM would take the answers) at the same time.
            /tmp/site/bin/py-spy record --pid "$load" --duration 5 --rate 100 --format raw --threads --idle \
                -o "$P/client-idle.txt" >"$P/py-spy-client.log" 2>&1 &
            client_spy=$!
            /tmp/site/bin/py-spy record --pid "$svc" --duration 5 --rate 100 --format raw --threads --idle \
                -o "$P/idle.txt" >"$P/py-spy.log" 2>&1
            wait "$client_spy"
            /tmp/site/bin/py-spy record --pid "$svc" --duration 5 --rate 100 --format raw --threads --gil \
                -o "$P/gil.txt" >>"$P/py-spy.log" 2>&1
            timeout 60 tail --pid "$load" -f /dev/null
            echo "== $name"; grep -c . "$P"/*.txt; grep "RESULT\|mean ms" "$P/load.log"
            python3 scripts/pyspy_summary.py "$P"/idle.txt "$P"/gil.txt "$P"/client-idle.txt --top 15 \
                >"$OUT/$name-summary.txt" 2>&1
            tar czf "$OUT/$name.tgz" -C "$OUT" prof && rm -rf "$P" ;;
        prefix-tests)  # issue 22: the LLM's CUDA tests (shared-page graph replay among them), the samplers' CUDA cases
            step prefix-tests 330 python3 -m pytest -q -p no:cacheprovider tests/test_llm_cuda.py tests/test_sampling.py \
                tests/test_structured.py -k "not tensor_parallel" ;;
        multiturn) step multiturn 420 python3 bench/multiturn.py ;;
        video-cuda)  # issue 21: video beside images on the vision encoder's CUDA preprocessing path (wheels: video set)
            step video-cuda 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_video_encoder.py \
                tests/test_vision_device_preprocess.py -k "cuda" ;;
        prefix-ab)  # issue 22: no sharing (random prompts), the cache on against off: in process, then served
            step llm-prefix-on 150 python3 bench/llm.py --batches 1,256,256 --no-hf
            step llm-prefix-off 150 python3 bench/llm.py --batches 1,256,256 --no-hf --no-prefix-caching
            step serve-prefix-on 170 python3 bench/serve.py --start --requests 2048
            step serve-prefix-off 170 python3 bench/serve.py --start --requests 2048 --llm-flag=--no-prefix-caching ;;
        edge-ab)  # issue 17: the engine in a process of its own behind the gRPC edge, against the code before
            # (.prev = git archive of it, carried), 4,096 requests each from 4 client processes (this tree's
            # bench on both), twice each, alternating
            cp bench/__init__.py bench/serve.py bench/llm.py .prev/bench/
            for run in 1 2; do
                step serve-edge$run 170 env CUDA_VISIBLE_DEVICES=0 python3 bench/serve.py --start --requests 4096
                step serve-prev$run 170 bash -c 'cd .prev && PYTHONPATH=/tmp/site:$PWD CUDA_VISIBLE_DEVICES=0 \
                    python3 bench/serve.py --start --requests 4096'
            done ;;
        table-17)  # issue 17's table on one GPU: the LLM's CUDA tests, decode beside HF, cuBLASLt at batch 1
            # (TORCH_BLAS_PREFER_CUBLASLT: does it drop down_proj's split-K reduce?), image+text on one GPU
            step cuda-tests 300 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider tests/test_llm_cuda.py
            step llm-table 200 env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,32,256
            step llm-cublaslt 120 env TORCH_BLAS_PREFER_CUBLASLT=1 CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py \
                --batches 1,32 --no-hf
            step placement-shared 150 env CUDA_VISIBLE_DEVICES=0 python3 bench/placement.py --layouts shared ;;
        prefill-17)  # issue 17, paged prefill kernel: its CUDA tests beside the LLM's (one GPU, both small), then
            # its launch configs and the attention bench's paged shapes (ours beside SDPA over gathered pages)
            step kernel-tests 270 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
                tests/test_attention_backends.py &
            step cuda-tests 270 python3 -m pytest -q -p no:cacheprovider tests/test_llm_cuda.py -k "not tensor_parallel" &
            wait
            step paged-prefill 120 python3 bench/paged_prefill.py
            grep -E "==|best|peer|bar" "$OUT/paged-prefill.log"
            step attention-paged 150 python3 bench/attention.py --only paged
            grep -E "==|triton_paged|sdpa_efficient|torch_varlen|selector" "$OUT/attention-paged.log" ;;
        table2-17)  # issue 17's table on one GPU, one call: decode beside HF, 256 streams, image+text by phase
            step llm-table 200 python3 bench/llm.py --batches 1,32,256
            step serve-table 170 python3 bench/serve.py --start --requests 4096
            step placement-shared 170 python3 bench/placement.py --layouts shared
            tail -8 "$OUT/placement-shared.log" ;;
        profile-edge)  # issue 17: 256 streams on the edge + engine process, who holds each process's GIL
            step profile-edge 200 /tmp/site/bin/py-spy record --subprocesses --threads --gil --rate 100 \
                --format raw -o "$OUT/profile-edge.txt" -- env CUDA_VISIBLE_DEVICES=0 python3 bench/serve.py --start \
                --requests 2048
            python3 scripts/pyspy_summary.py "$OUT/profile-edge.txt" --top 12 >"$OUT/profile-edge-summary.txt" 2>&1
            gzip -f "$OUT/profile-edge.txt" ;;
        profile-placement)  # issue 17: image+text on one GPU (64 concurrent, 448^2, 64 out), every process's GIL
            step profile-placement 200 /tmp/site/bin/py-spy record --subprocesses --threads --gil --rate 100 \
                --format raw -o "$OUT/profile-placement.txt" -- env CUDA_VISIBLE_DEVICES=0 python3 bench/placement.py \
                --layouts shared
            python3 scripts/pyspy_summary.py "$OUT/profile-placement.txt" --top 12 \
                >"$OUT/profile-placement-summary.txt" 2>&1
            gzip -f "$OUT/profile-placement.txt" ;;
        gemv)  # issue 17's batch-1 row: the products alone (cuBLAS against the Triton GEMV's configs), its CUDA
            # tests, then decode with and without it
            step gemv-tests 240 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py
            step gemv 240 env CUDA_VISIBLE_DEVICES=0 python3 bench/gemv.py
            step llm-gemv 120 env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,4,32 --no-hf
            step llm-cublas 120 env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,4,32 --no-hf --no-gemv ;;
        final-gemv)  # the GEMV on by default: the LLM's CUDA tests, decode A/B with it off, serving once more
            step cuda-tests 300 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider \
                tests/test_llm_cuda.py tests/test_gemv.py
            step llm-gemv 120 env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,2,4,32 --no-hf
            step llm-cublas 120 env CUDA_VISIBLE_DEVICES=0 python3 bench/llm.py --batches 1,2,4,32 --no-hf --no-gemv
            step serve-final 170 env CUDA_VISIBLE_DEVICES=0 python3 bench/serve.py --start --requests 4096 ;;
        profile-19)  # issue 19: where our towers' and decoder's kernel time goes, at the table's shapes (no compiled
            # peer here: table-19 has it). Estimates (the step lines print the real seconds): 60, 65, 35 s
            step vision-profile 75 python3 bench/vision.py --only siglip-b32,qwen2vl-8x448,qwen25vl-8x448 --iters 10 \
                --no-hf --peer-compile none --profile
            step audio-profile 80 python3 bench/audio.py --batch 1 16 --iters 10 --peer-compile none --profile \
                --profile-batch 1 16
            step vae-profile 50 python3 bench/vae.py --sizes 1024 --largest '' --peer-compile none --profile
            # each profile's wall / busy / idle table and its calls' kernel families (the top kernels: the logs)
            awk '/^profile,/ {on = 1} /^(top kernels|kernel families)/ {on = 0} on || /^kernel families/' "$OUT"/{vision,audio,vae}-profile.log ;;
        table-19)  # issue 19's table: ours, the eager peer and HF under torch.compile (default mode; a fresh inductor
            # cache each, so the compile seconds are a cold start), the VAE without its compiled peer (vae-compiled-19).
            # With profile-19 in one 600 s call: 565 s of limits + about 30 s of set-up. Estimates: 150 s (three
            # compiles, SigLIP's the longest), 110 s (two compiles), 35 s
            tower_tables
            step vae-table 50 python3 bench/vae.py --sizes 1024 --largest-sides 4096 --peer-compile none
            grep -h -E "^(# HF|case|siglip|qwen)" "$OUT/vision-table.log"
            grep -h -E "^(HF under|parity|batch| +[0-9]+ )" "$OUT/audio-table.log"
            grep -h "^|" "$OUT/vae-table.log" ;;
        kernels-19)  # issue 19: the towers' and the VAE's new Triton kernels against PyTorch's path on CUDA, then
            # what they buy: the VAE at 1024^2 (ours fused NCHW / NHWC beside ours unfused and diffusers), the Qwen
            # towers with and without them (ours only). Fits a call with ~290 s of device time left.
            step kernels-tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
                -k "group_norm or vae_decoder or vision"
            step vae-kernels 55 python3 bench/vae.py --sizes 1024 --dtypes bfloat16,float32 --largest '' \
                --peer-compile none --warmup 2 --iters 5
            step vision-fused 45 python3 bench/vision.py --only qwen2vl-8x448,qwen25vl-8x448 --iters 10 --no-hf \
                --peer-compile none
            step vision-unfused 45 python3 bench/vision.py --only qwen2vl-8x448,qwen25vl-8x448 --iters 10 --no-hf \
                --peer-compile none --no-fused-kernels
            grep -h "^|" "$OUT/vae-kernels.log"
            grep -h -E "^(# vision|case|qwen)" "$OUT"/vision-fused.log "$OUT"/vision-unfused.log ;;
        groupnorm-19)  # issue 19: the Triton GroupNorm(+SiLU) against PyTorch's path, then the VAE at 1024^2 with
            # it (NCHW, NHWC) beside ours unfused and diffusers eager, and where the kernel time goes now
            step groupnorm-tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_vae_cuda.py \
                -k "group_norm or vae_decoder or parity"
            step vae-groupnorm 120 python3 bench/vae.py --sizes 1024 --largest '' --peer-compile none --profile
            grep -h "^|" "$OUT/vae-groupnorm.log"
            awk '/^profile,/ {on = 1} /^(top kernels|kernel families)/ {on = 0} on || /^kernel families/' \
                "$OUT/vae-groupnorm.log" ;;
        check-19)  # issue 19, 2026-12-05 call 1: the GroupNorm fixes and the VAE with the kernel (NCHW, NHWC; cuDNN
            # benchmark mode off and on), Whisper with its row-major stem beside HF, each profiled. ~330 s of limits
            step kernels-tests 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_audio_models.py \
                -k "group_norm or vae_decoder or vision or row_major or bf16_on_cuda"
            step vae-kernels 90 python3 bench/vae.py --sizes 1024 --largest '' --peer-compile none --warmup 2 --iters 5 \
                --profile
            step vae-cudnn 70 python3 bench/vae.py --sizes 1024 --largest-sides 4096 --peer-compile none --warmup 2 \
                --iters 5 --cudnn-benchmark --no-unfused
            step audio-19 90 python3 bench/audio.py --batch 1 16 --iters 10 --peer-compile none --profile \
                --profile-batch 16
            grep -h "^|" "$OUT"/vae-kernels.log "$OUT"/vae-cudnn.log
            grep -h -E "^(parity|batch| +[0-9]+ |ours)" "$OUT/audio-19.log"
            awk '/^profile,/ {on = 1} /^(top kernels|kernel families)/ {on = 0} on || /^kernel families/' \
                "$OUT"/vae-kernels.log "$OUT"/audio-19.log ;;
        vae2-19)  # issue 19, 2026-12-05 call 2: GroupNorm stats per lane, conv biases in GroupNorm and the residual
            # kernel, the NHWC upsample; the VAE's CUDA tests, the 1024^2 table profiled, tiled 4096^2 (NCHW, NHWC)
            step vae-tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_vae_cuda.py \
                -k "group_norm or vae_decoder or bias_and_residual or cuda"
            step vae-1024 90 python3 bench/vae.py --sizes 1024 --largest '' --peer-compile none --warmup 2 --iters 5 \
                --profile
            step vae-tiled 80 python3 bench/vae.py --sizes 512 --dtypes bfloat16 --largest-sides 4096 --peer-compile none \
                --no-unfused --warmup 1 --iters 2
            step vae-tiled-nhwc 80 python3 bench/vae.py --sizes 512 --dtypes bfloat16 --largest-sides 4096 \
                --peer-compile none --no-unfused --warmup 1 --iters 2 --largest-channels-last
            grep -h "^|" "$OUT"/vae-1024.log "$OUT"/vae-tiled.log "$OUT"/vae-tiled-nhwc.log
            awk '/^profile,/ {on = 1} /^(kernel families)/ {on = 0} on || /^kernel families/' "$OUT"/vae-1024.log
            grep -h -A8 "^top kernels, ours N.* bfloat16" "$OUT"/vae-1024.log | cut -c1-150 ;;
        vae3-19)  # issue 19, 2026-12-06 call 1: conv_in's and the upsamplers' biases folded into the next block, the
            # upsample written by the residual add, hd512 attention as two GEMMs (matmul_chunked); their CUDA tests, the
            # attention bench at hd512, the 1024^2 profile, and bf16 with the old attention (sdpa_efficient) beside it
            step vae3-tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_vae_cuda.py \
                tests/test_attention_backends.py tests/test_attention_selection.py \
                -k "group_norm or vae_decoder or bias_and_residual or softmax or cuda or matmul_chunked or hopper"
            step attention-hd512 90 python3 bench/attention.py --only hd512
            step vae3-1024 90 python3 bench/vae.py --sizes 1024 --largest '' --peer-compile none --warmup 2 --iters 5 \
                --profile
            step vae3-efficient 60 python3 bench/vae.py --sizes 1024 --dtypes bfloat16 --largest '' --peer-compile none \
                --warmup 2 --iters 5 --no-unfused --attention-backend vae=sdpa_efficient
            grep -h -A3 "^== summary" "$OUT/attention-hd512.log"
            grep -h "^|" "$OUT"/vae3-1024.log "$OUT"/vae3-efficient.log
            awk '/^profile,/ {on = 1} /^(kernel families)/ {on = 0} on || /^kernel families/' "$OUT"/vae3-1024.log
            grep -h -A12 "^top kernels, ours N.* bfloat16" "$OUT"/vae3-1024.log | cut -c1-150 ;;
        gn-sweep-19)  # issue 19: the GroupNorm kernels' launch configs over the 1024^2 decoder's GroupNorms (bf16 NHWC)
            step gn-sweep 150 python3 bench/group_norm.py
            cat "$OUT/gn-sweep.log" ;;
        vae-table-19)  # issue 19's VAE rows again, as final-19 measured them: diffusers eager and compiled channels-last
            # (default mode, a cold inductor cache), and the tiled 4096^2 in NHWC
            step vae-table 235 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --largest-sides 4096 --largest-channels-last --peer-channels-last --warmup 2 --iters 5
            grep -h "^|\|^# diffusers" "$OUT/vae-table.log" ;;
        final-19)  # issue 19's table in one call: the towers with HF eager and compiled (default mode, a cold inductor
            # cache each), Whisper likewise, the VAE beside diffusers eager and compiled channels-last (its docs'
            # recipe), and the tiled 4096^2 in NHWC. Limits sum to 545 s
            tower_tables
            step vae-table 235 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --largest-sides 4096 --largest-channels-last --peer-channels-last --warmup 2 --iters 5
            grep -h -E "^(# HF|case|siglip|qwen)" "$OUT/vision-table.log"
            grep -h -E "^(HF under|parity|batch| +[0-9]+ )" "$OUT/audio-table.log"
            grep -h "^|\|^# diffusers" "$OUT/vae-table.log" ;;
        vae-compiled-19)  # issue 19: diffusers' decode compiled (default mode, 1024^2, FP32 and bf16), as is and in
            # channels-last (its docs' recipe); about 150 s each, mostly the four compiles
            step vae-compiled 200 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --largest '' --no-channels-last
            step vae-compiled-nhwc 200 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --largest '' --no-channels-last --peer-channels-last
            grep -h "^|\|^# diffusers" "$OUT"/vae-compiled{,-nhwc}.log ;;
        vae-autotune-19)  # issue 19's strongest VAE peer: diffusers compiled with max-autotune at 1024^2 bf16 (the issue
            # measured 250 s to compile)
            step vae-autotune 540 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --dtypes bfloat16 --largest '' --no-channels-last --peer-compile max-autotune
            grep -h "^|" "$OUT/vae-autotune.log" ;;
        siglip-autotune-19)  # issue 19's strongest SigLIP peer: HF compiled with max-autotune at batch 32
            step siglip-autotune 540 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vision.py \
                --only siglip-b32 --peer-compile max-autotune
            grep -h -E "^(# HF|case|siglip)" "$OUT/siglip-autotune.log" ;;
        where-18)  # issue 18: where an image request's time goes before the engine has it (one GPU): the transfer
            # bench split by stage, then image+text on one GPU by phase with py-spy attached once the load runs
            step transfer 150 python3 bench/transfer.py --sizes 448,2688
            profile_placement where-18 shared "${REQUESTS:-768}" ;;
        ab-18)  # issue 18: the kernel forms compiled before serving (CUDA tests), then image+text on one GPU by phase,
            # this tree against the code before (.prev: git archive REV, carried), then the transfer split again
            step tests-18 240 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
                tests/test_llm_cuda.py -k "not tensor_parallel"
            # Each run with a Triton cache of its own, as a fresh container starts: else the second run would load
            # the first's compiled kernels from disk
            step placement-now 200 env TRITON_CACHE_DIR="$(mktemp -d)" CUDA_VISIBLE_DEVICES=0 python3 \
                bench/placement.py --layouts shared --requests "${REQUESTS:-512}"
            step placement-prev 200 bash -c "cd .prev && TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/site:\$PWD \
                CUDA_VISIBLE_DEVICES=0 python3 bench/placement.py --layouts shared --requests ${REQUESTS:-512}"
            tail -22 "$OUT/placement-now.log"; tail -14 "$OUT/placement-prev.log" ;;
        towers-19)  # issue 19, 2026-12-06: fa3 through its config alias, the add+LayerNorm and quick-GELU kernels, tanh
            # GELU in the GEMM epilogue, the towers' residual stream. The CUDA tests, attention at the towers' shapes,
            # then each tower as built (HF eager beside) against --no-fused-kernels and against the backend next in
            # rank. No compiled peer (final-19 has it). Limits sum to 560 s; estimates 5, 90, 45, 80, 4 x 50, 60, 50 s
            step fa3-probe 30 python3 -c 'from modalmesh.attention import registry
p = registry.probe("fa3"); print("fa3:", "loaded from " + p.backend.module_name if p.ok else p.reason)'
            cat "$OUT/fa3-probe.log"
            step towers-tests 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
                tests/test_attention_backends.py tests/test_vision_models.py tests/test_audio_models.py \
                -k "layer_norm or quick_gelu or tower or epilogue or cuda"
            step attention-towers 50 python3 bench/attention.py --only "s729 siglip"
            step vision-ab 100 python3 bench/vision.py --only siglip-b32,qwen2vl-8x448,qwen25vl-8x448 --iters 10 \
                --peer-compile none
            step vision-unfused 60 python3 bench/vision.py --only siglip-b32,qwen2vl-8x448,qwen25vl-8x448 \
                --iters 10 --no-hf --peer-compile none --no-fused-kernels
            step vision-cudnn 40 python3 bench/vision.py --only siglip-b32 --iters 10 --no-hf --peer-compile none \
                --attention-backend vision_encoder=sdpa_cudnn
            step vision-varlen 50 python3 bench/vision.py --only qwen2vl-8x448,qwen25vl-8x448 --iters 10 --no-hf \
                --peer-compile none --attention-backend vision_encoder=torch_varlen
            step audio-ab 70 python3 bench/audio.py --batch 1 16 --iters 10 --peer-compile none
            step audio-unfused 60 python3 bench/audio.py --batch 1 16 --iters 10 --no-hf --peer-compile none \
                --no-fused-kernels
            grep -h -E "pick|fa3|sdpa_cudnn" "$OUT"/attention-towers.log | head -30
            for f in vision-ab vision-unfused vision-cudnn vision-varlen; do echo "-- $f"
                grep -h -E "^(# vision|attention|case|siglip|qwen)" "$OUT/$f.log"; done
            for f in audio-ab audio-unfused; do echo "-- $f"
                grep -h -E "^(attention|parity|batch| +[0-9]+ )" "$OUT/$f.log"; done ;;
        vae4-19)  # issue 19, stop 50 call 1: the residual add that takes the next GroupNorm's statistics, and the
            # upsample + conv as 2x2 phase convolutions. Their CUDA tests; bf16 1024^2 and the tiled 4096^2 on .prev
            # (`git archive bf09df3`), .mid (`git archive c43cec5`: the moments alone; both carried) and this tree,
            # profiled; then our VAE service's start from an empty cache and again. Limits sum to 450 s
            step vae4-tests 80 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_vae_cuda.py \
                -k "moments or vae_decoder or bias_and_residual or upsampled_conv or phase or vae"
            vae_args=(--sizes 1024 --dtypes bfloat16 --largest-sides 4096 --largest-channels-last --peer-compile none
                      --no-unfused --warmup 2 --iters 10)
            on_tree .prev vae4-prev 80 bench/vae.py "${vae_args[@]}"
            on_tree .mid vae4-mid 80 bench/vae.py "${vae_args[@]}"
            step vae4-new 110 python3 bench/vae.py "${vae_args[@]}" --profile
            step startup-vae 100 python3 bench/startup.py --services vae --peer-modes ''
            for f in vae4-prev vae4-mid vae4-new; do echo "-- $f"; grep -h "^|" "$OUT/$f.log"; done
            awk '/^profile,/ {on = 1} /^(kernel families)/ {on = 0} on || /^kernel families/' "$OUT"/vae4-new.log
            grep -h -A12 "^top kernels, ours NHWC" "$OUT"/vae4-new.log | cut -c1-150
            grep -h "^| [op]" "$OUT"/startup-vae.log ;;
        vae5-19)  # issue 19, stop 50 call 2 (the warm machine after vae4-19): the GroupNorm launch-config sweep, then
            # the VAE rows of the table beside diffusers eager and compiled channels-last (a cold inductor cache),
            # batch 4 (the tiles' batch). Limits sum to 435 s
            step gn-sweep 150 python3 bench/group_norm.py
            step vae-table 235 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --largest-sides 4096 --largest-channels-last --peer-channels-last --warmup 2 --iters 5
            step vae4-b4 50 python3 bench/vae.py --sizes 1024 --dtypes bfloat16 --largest '' --peer-compile none \
                --no-unfused --warmup 2 --iters 5 --batch 4
            tail -20 "$OUT/gn-sweep.log"
            grep -h "^|\|^# diffusers" "$OUT"/vae-table.log "$OUT"/vae4-b4.log ;;
        vae6-19)  # issue 19, stop 50 call 3: the CUDA tests again after the inference-mode fix (phase kernels'
            # cache key), then bf16 1024^2 beside diffusers eager and compiled channels-last (a cold inductor
            # cache). Limits sum to 200 s
            step vae6-tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_vae_cuda.py \
                -k "moments or vae_decoder or bias_and_residual or upsampled_conv or phase or vae or group_norm"
            step vae-table 110 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --dtypes bfloat16 --largest '' --peer-channels-last --warmup 2 --iters 5 --no-unfused
            grep -h "^|\|^# diffusers" "$OUT/vae-table.log" ;;
        vae7-19)  # issue 19, stop 51 call 1: the CUDA tests (stop 50's inference-mode fix, the graphed engine, apply
            # tiles per program), each GroupNorm pass alone per shape over warps and tiles per program, bf16 1024^2
            # with the graphed column (the service's path) and the tiled 4096^2 graphed, profiled; the tiled decode
            # eager beside it; the VAE service's start (the tile-size warm-up and the capture). Limits sum to 540 s
            step vae7-tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_vae_cuda.py \
                -k "moments or vae_decoder or bias_and_residual or upsampled_conv or phase or vae or group_norm"
            step gn-passes 150 python3 bench/group_norm.py --passes
            step vae7 110 python3 bench/vae.py --sizes 1024 --dtypes bfloat16 --largest-sides 4096 \
                --largest-channels-last --peer-compile none --no-unfused --warmup 2 --iters 10 --profile
            step vae7-eager-tiled 60 python3 bench/vae.py --sizes '' --dtypes bfloat16 --largest-sides 4096 \
                --largest-channels-last --peer-compile none --no-cuda-graphs
            step startup-vae 100 python3 bench/startup.py --services vae --peer-modes ''
            cat "$OUT/gn-passes.log"
            grep -h "^|\|^# largest" "$OUT"/vae7.log "$OUT"/vae7-eager-tiled.log
            awk '/^profile,/ {on = 1} /^(kernel families)/ {on = 0} on || /^kernel families/' "$OUT"/vae7.log
            grep -h -A14 "^top kernels, ours NHWC" "$OUT"/vae7.log | cut -c1-150
            grep -h "^| [op]" "$OUT"/startup-vae.log ;;
        vae8-19)  # issue 19, stop 51, call 1 of 2 (vae7-19 regrouped so that one call has the VAE's rows whole): the
            # CUDA tests; the VAE rows beside diffusers eager and compiled channels-last (a cold inductor cache) with the
            # graphed column and the tiled 4096^2 graphed, profiled; each GroupNorm pass alone; the VAE service's start.
            # Limits sum to 560 s
            step vae8-tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_vae_cuda.py \
                -k "moments or vae_decoder or bias_and_residual or upsampled_conv or phase or vae or group_norm"
            step vae-table 250 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --largest-sides 4096 --largest-channels-last --peer-channels-last --warmup 2 --iters 5 --no-unfused \
                --profile
            step gn-passes 100 python3 bench/group_norm.py --passes
            step startup-vae 90 python3 bench/startup.py --services vae --peer-modes ''
            grep -h "^|\|^# diffusers\|^# largest\|^# ours" "$OUT/vae-table.log"
            awk '/^profile,/ {on = 1} /^(kernel families)/ {on = 0} on || /^kernel families/' "$OUT"/vae-table.log
            grep -h -A14 "^top kernels, ours NHWC bfloat16" "$OUT"/vae-table.log | cut -c1-150
            cat "$OUT/gn-passes.log"
            grep -h "^| [op]" "$OUT"/startup-vae.log ;;
        towers8-19)  # issue 19, stop 51, call 2 of 2 (the warm machine after vae8-19): the towers beside HF eager and
            # compiled, the tiled 4096^2 eager (the graphs' A/B), then where the towers' time goes. Limits sum to 540 s
            tower_tables
            step vae-eager-tiled 60 python3 bench/vae.py --sizes '' --dtypes bfloat16 --largest-sides 4096 \
                --largest-channels-last --peer-compile none --no-cuda-graphs
            step vision-profile 90 python3 bench/vision.py --only siglip-b32,qwen2vl-8x448,qwen25vl-8x448 --iters 10 \
                --no-hf --peer-compile none --profile
            step audio-profile 80 python3 bench/audio.py --batch 1 16 --iters 10 --peer-compile none --profile \
                --profile-batch 1 16
            grep -h -E "^(# HF|# vision|case|siglip|qwen)" "$OUT/vision-table.log"
            grep -h -E "^(attention|HF under|parity|batch| +[0-9]+ )" "$OUT/audio-table.log"
            grep -h "^|\|^# largest" "$OUT/vae-eager-tiled.log"
            awk '/^profile,/ {on = 1} /^(top kernels|kernel families)/ {on = 0} on || /^kernel families/' \
                "$OUT"/{vision,audio}-profile.log ;;
        towers9-19)  # towers8-19 without the profiles (what the device time left after vae8-19 allows): limits sum
            # to 370 s
            tower_tables
            step vae-eager-tiled 60 python3 bench/vae.py --sizes '' --dtypes bfloat16 --largest-sides 4096 \
                --largest-channels-last --peer-compile none --no-cuda-graphs
            grep -h -E "^(# HF|# vision|case|siglip|qwen)" "$OUT/vision-table.log"
            grep -h -E "^(attention|HF under|parity|batch| +[0-9]+ )" "$OUT/audio-table.log"
            grep -h "^|\|^# largest" "$OUT/vae-eager-tiled.log" ;;
        stop54-19)  # issue 19, stop 54, call 1 of 2 (one H100 or H200): the kernels' float casts and SigLIP's padded MLP
            # on CUDA, SigLIP padded against not, our VAE compiled, then the towers beside HF eager and compiled.
            # Limits sum to 650 s: what matters most comes first
            step cuda-19 60 python3 -m pytest -q -p no:cacheprovider tests/test_vision_models.py \
                tests/test_kernels.py -k "bf16_cuda_parity or scaled_softmax or group_norm"
            step siglip-unpadded 60 python3 bench/vision.py --only siglip-b32 --no-hf --siglip-mlp-pad-to 1
            step siglip-padded 60 python3 bench/vision.py --only siglip-b32 --no-hf
            step vae-ours-compiled 150 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --dtypes bfloat16 --largest '' --peer-compile none --no-unfused --ours-compile default --warmup 2 --iters 10
            grep -h -E "^(case|siglip)" "$OUT"/siglip-{unpadded,padded}.log
            grep -h "^|\|^# ours compiled" "$OUT/vae-ours-compiled.log"
            tower_tables
            grep -h -E "^(# HF|# vision|case|siglip|qwen)" "$OUT/vision-table.log"
            grep -h -E "^(attention|HF under|parity|batch| +[0-9]+ )" "$OUT/audio-table.log" ;;
        pad-ab-19)  # issue 19, stop 54, what little device time is left: SigLIP padded against not, twice each, its
            # bf16 CUDA parity with HF, our VAE compiled. Limits sum to 385 s, the most needed first
            step siglip-unpadded 50 python3 bench/vision.py --only siglip-b32 --no-hf --siglip-mlp-pad-to 1
            step siglip-padded 50 python3 bench/vision.py --only siglip-b32 --no-hf
            step cuda-pad 45 python3 -m pytest -q -p no:cacheprovider tests/test_vision_models.py -k "bf16_cuda_parity"
            step siglip-unpadded2 45 python3 bench/vision.py --only siglip-b32 --no-hf --siglip-mlp-pad-to 1
            step siglip-padded2 45 python3 bench/vision.py --only siglip-b32 --no-hf
            step vae-ours-compiled 150 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --dtypes bfloat16 --largest '' --peer-compile none --no-unfused --ours-compile default --warmup 2 --iters 10
            grep -h -E "^(# vision|case|siglip)" "$OUT"/siglip-{unpadded,padded,unpadded2,padded2}.log
            grep -h "^|\|^# ours compiled" "$OUT/vae-ours-compiled.log" ;;
        stop54-vae-19)  # issue 19, stop 54, call 2 of 2 (the warm machine after stop54-19): the VAE rows beside diffusers
            # eager and compiled (a cold inductor cache), graphed, tiled 4096^2; the VAE service's start. Limits 340 s
            step vae-table 250 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --largest-sides 4096 --largest-channels-last --peer-channels-last --warmup 2 --iters 5 --no-unfused
            step startup-vae 90 python3 bench/startup.py --services vae --peer-modes ''
            grep -h "^|\|^# diffusers\|^# largest\|^# ours" "$OUT/vae-table.log"
            grep -h "^| [op]" "$OUT"/startup-vae.log ;;
        ours-compiled-19)  # issue 19: our VAE decoder under torch.compile (default mode) beside its eager self, bf16 1024²
            step vae-ours-compiled 150 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/vae.py --sizes 1024 \
                --dtypes bfloat16 --largest '' --peer-compile none --no-unfused --ours-compile default --warmup 2 --iters 10
            grep -h "^|\|^# ours compiled" "$OUT/vae-ours-compiled.log" ;;
        gemm-19)  # issue 19, stop 53: each tower's GEMMs alone beside this GPU's best cuBLAS rate (what bounds the
            # towers: their ceiling with cuBLAS), each tower's costliest GEMM and fc1 + its activation under
            # max-autotune (a cold inductor cache: five compiles, a guess of 40-60 s each). Limit 400 s
            step gemm 400 env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python3 bench/gemm.py --autotune 1
            grep -v "^ *$" "$OUT/gemm.log" | grep -v "Warning\|warn(" ;;
        startup-19)  # issue 19's warm start: seconds to SERVING with an empty --compile-cache and with the one that
            # start filled, for the VAE (and its first 1024² decode) and the LLM (Qwen2.5-7B shape, the most kernel
            # forms), then diffusers' VAE compiled (default mode) started the same two ways. Limits sum to 500 s
            step startup-vae 100 python3 bench/startup.py --services vae --peer-modes ''
            step startup-llm 200 python3 bench/startup.py --services llm --peer-modes ''
            step startup-peer 200 python3 bench/startup.py --services '' --peer-modes default
            grep -h "^| [op]" "$OUT"/startup-{vae,llm,peer}.log ;;
        profile-towers-19)  # issue 19, after towers-19: where the towers' time goes now (limits sum to 170 s)
            step vision-profile 90 python3 bench/vision.py --only siglip-b32,qwen2vl-8x448,qwen25vl-8x448 --iters 10 \
                --no-hf --peer-compile none --profile
            step audio-profile 80 python3 bench/audio.py --batch 1 16 --iters 10 --peer-compile none --profile \
                --profile-batch 1 16
            awk '/^profile,/ {on = 1} /^(top kernels|kernel families)/ {on = 0} on || /^kernel families/' \
                "$OUT"/{vision,audio}-profile.log ;;
        towers-table-19)  # final-19 without the VAE (unchanged since its last table): the towers with HF eager and
            # compiled, then the fused-tower tests as fixed after towers-19. Limits sum to 355 s
            tower_tables
            step towers-tests2 45 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k tower
            grep -h -E "^(# HF|# vision|case|siglip|qwen)" "$OUT/vision-table.log"
            grep -h -E "^(attention|HF under|parity|batch| +[0-9]+ )" "$OUT/audio-table.log" ;;
        norms-check-19)  # issue 19's review mends (int64 rows, the fusable rules) on CUDA: the norm and tower kernels' tests
            step norms-check 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
                -k "norm or quick_gelu or tower or epilogue" ;;
        table3-17)  # issue 17's table on one GPU, one call (2026-12-06 session 2): the graph-path metric's CUDA test,
            # decode beside HF, 256 streams, image+text in the embeddings layout (the LLM alone: what its GPU serves
            # of the split layout's load) beside shared. Limits sum to 590 s
            step metric-test 60 python3 -m pytest -q -p no:cacheprovider tests/test_llm_cuda.py -k graph_steps_equal
            step llm-table 160 python3 bench/llm.py --batches 1,32,256
            step serve-table 140 python3 bench/serve.py --start --requests 4096
            step placement-emb 230 python3 bench/placement.py --layouts embeddings,shared
            tail -8 "$OUT/llm-table.log"; tail -12 "$OUT/serve-table.log"; tail -36 "$OUT/placement-emb.log" ;;
        where-17)  # issue 17: image+text in the embeddings layout (the LLM alone), py-spy attached once the load runs;
            # LLM_ARGS: more LLM flags (e.g. "--switch-interval-ms 0.5")
            profile_placement where-17 embeddings "${REQUESTS:-1024}" "${LLM_ARGS:-}" ;;
        frames-17)  # issue 17 (2026-12-07): image+text in the embeddings layout (the LLM alone), 1,024 requests, on
            # the code before (.prev: `git archive 438797b`, carried: StreamReader frames, positions per chunk,
            # digests sized by ByteSize) and on this tree at Python's 5 ms GIL switch interval and at 0.5 ms; then
            # the M-RoPE CUDA tests (packed positions) and bench/link.py. The A/B first: a call cut short by the
            # budget still brings it back. Limits sum to 360 s
            step placement-prev 90 bash -c 'cd .prev && PYTHONPATH=/tmp/site:$PWD python3 bench/placement.py \
                --layouts embeddings --requests "${REQUESTS:-1024}"'
            step placement-5ms 90 python3 bench/placement.py --layouts embeddings --requests "${REQUESTS:-1024}"
            step placement-05ms 90 python3 bench/placement.py --layouts embeddings --requests "${REQUESTS:-1024}" \
                --llm-args "--switch-interval-ms 0.5"
            for f in placement-prev placement-5ms placement-05ms; do echo "-- $f"
                grep -E "^ +embeddings \|" "$OUT/$f.log"; done
            step mrope-tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_llm_cuda.py -k "qwen2_vl and not tensor"
            step link-bench 30 python3 bench/link.py --frames 100
            tail -5 "$OUT/link-bench.log" ;;
        post-17)  # issue 17 (2026-12-07 session 2), one call: the fused M-RoPE kernel's CUDA tests, then three trees
            # with this tree's benches (the tokenizer covers the model's vocabulary; bench/llm.py keeps deltas
            # without a lock): .prev (`git archive b8c2290`: before this session), .mid (HEAD~1 of the M-RoPE commit:
            # the post phase's DecodeStream and observe_many) and this tree (+ M-RoPE in the fused kernel); both
            # carried, each holding modalmesh, services, bench, proto. Image+text (embeddings layout) on all three,
            # in process and 256 streams on .prev and this tree (text: no M-RoPE), then image+text with every step
            # within the mixed graphs (--max-batch-tokens 1024: the eager steps were 5 % of the steps and 39 % of
            # the engine thread in this morning's where-17). Most valuable first: a call cut at 600 s keeps them
            step mrope-kernel-tests 70 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "rope or decoder"
            step mrope-llm-tests 50 python3 -m pytest -q -p no:cacheprovider tests/test_llm_cuda.py -k "qwen2_vl and not tensor"
            emb=(bench/placement.py --layouts embeddings --requests "${REQUESTS:-1024}")
            on_tree .prev placement-prev 65 "${emb[@]}"
            on_tree .mid placement-mid 65 "${emb[@]}"
            step placement-new 65 python3 "${emb[@]}"
            on_tree .prev llm-prev 55 bench/llm.py --batches 1,32,256 --no-hf
            step llm-new 75 python3 bench/llm.py --batches 1,32,256
            on_tree .prev serve-prev 70 bench/serve.py --start --requests 4096
            step serve-new 70 python3 bench/serve.py --start --requests 4096
            step placement-1024 65 python3 "${emb[@]}" --llm-args "--max-batch-tokens 1024"
            for f in placement-prev placement-mid placement-new placement-1024; do echo "-- $f"
                grep -E "^ +embeddings \|" "$OUT/$f.log"; done
            for f in llm-prev llm-new; do echo "-- $f"; grep -E "^ +(batch|[0-9]+ )|limit|RESULT" "$OUT/$f.log"; done
            for f in serve-prev serve-new; do echo "-- $f"; grep -E "^TP=" "$OUT/$f.log" | tail -1; done ;;
        short-17)  # post-17 cut to a budget near 300 s (2026-12-07: the rest went on failed starts): the fused M-RoPE
            # kernel's CUDA tests, image+text on this tree, in process on this tree (HF beside) and on .prev, then
            # image+text on .mid (the post phase alone); a call cut short keeps what ran
            step mrope-kernel-tests 55 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "rope or decoder"
            step mrope-llm-tests 35 python3 -m pytest -q -p no:cacheprovider tests/test_llm_cuda.py -k "qwen2_vl and not tensor"
            emb=(bench/placement.py --layouts embeddings --requests "${REQUESTS:-1024}")
            step placement-new 65 python3 "${emb[@]}"
            grep -E "^ +embeddings \|" "$OUT/placement-new.log"
            step llm-new 60 python3 bench/llm.py --batches 1,32,256
            grep -E "^ +(batch|[0-9]+ )|limit" "$OUT/llm-new.log"
            on_tree .prev llm-prev 50 bench/llm.py --batches 1,32,256 --no-hf
            grep -E "^ +(batch|[0-9]+ )|limit" "$OUT/llm-prev.log"
            on_tree .mid placement-mid 65 "${emb[@]}"
            grep -E "^ +embeddings \|" "$OUT/placement-mid.log" ;;
        graphs-17)  # issue 17: image+text (embeddings layout) with the mixed graphs' largest bucket at 1,024 tokens (the
            # default when it ran), 2,048 (the default since) and 4,096 (--max-graph-tokens), and with the step budget cut to 1,024 instead, in one
            # call (~420 s); the CUDA tests of the graph paths first (the sync-free submit takes --max-graph-tokens 16)
            step graph-tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_llm_cuda.py -k "submitting or graph"
            emb=(bench/placement.py --layouts embeddings --requests "${REQUESTS:-1024}")
            step placement-g1024 65 python3 "${emb[@]}" --llm-args "--max-graph-tokens 1024"
            step placement-g2048 65 python3 "${emb[@]}" --llm-args "--max-graph-tokens 2048"
            step placement-g4096 65 python3 "${emb[@]}" --llm-args "--max-graph-tokens 4096"
            step placement-b1024 65 python3 "${emb[@]}" --llm-args "--max-batch-tokens 1024"
            for f in placement-g1024 placement-g2048 placement-g4096 placement-b1024; do echo "-- $f"
                grep -E "^ +embeddings \|" "$OUT/$f.log"; done
            # then where the b256 step's host time goes (in process; the whole run sampled, load included)
            step where-b256 120 /tmp/site/bin/py-spy record --threads --idle --rate 100 --format raw \
                -o "$OUT/where-b256.txt" -- python3 bench/llm.py --batches 256 --no-hf
            grep -E "^ +(batch|[0-9]+ )" "$OUT/where-b256.log"
            python3 scripts/pyspy_summary.py "$OUT/where-b256.txt" --top 20 >"$OUT/where-b256-summary.txt" 2>&1 ;;
        budget2-17)  # issue 17 (stop 52, call 1, ~390 s; replaces budget-17, never run): what the step token budget (--max-batch-tokens) costs
            # long prompts and buys mixed loads, one started service per budget: a lone 3,968-token prompt at a
            # time (its TTFT alone), then 16 streams of them (64 out; the bench's service takes 4,096) at 512 /
            # 1,024 / 2,048 / 8,192; then 256 text streams (128/128) at 1,024, and image+text (embeddings
            # layout) at 1,024 and 8,192 in the same call as controls (512 .. 2,048 ran on 2026-12-07)
            for b in 512 1024 2048 8192; do
                step long-b$b 90 python3 bench/serve.py --start --concurrency 1,16 --requests 12,64 --prompt-len 3968 \
                    --output-len 64 --llm-flag=--max-batch-tokens=$b
            done
            step serve-b1024 70 python3 bench/serve.py --start --requests 4096 --llm-flag=--max-batch-tokens=1024
            emb=(bench/placement.py --layouts embeddings --requests "${REQUESTS:-1024}")
            step placement-b1024 65 python3 "${emb[@]}" --llm-args "--max-batch-tokens 1024"
            step placement-b8192 65 python3 "${emb[@]}" --llm-args "--max-batch-tokens 8192"
            for f in placement-b1024 placement-b8192; do echo "-- $f"; grep -A3 -E "^ +embeddings \|" "$OUT/$f.log"; done ;;
        table4-17)  # issue 17's table on one GPU, one call (stop 52), the step budget's default at 1,024: decode beside
            # HF, 256 streams at the default and at 8,192, image+text in the embeddings layout (the LLM alone: what its
            # GPU serves of the split layout's load) beside shared. Limits sum to 590 s
            step llm-table 150 python3 bench/llm.py --batches 1,32,256
            step serve-table 110 python3 bench/serve.py --start --requests 4096
            step serve-b8192 90 python3 bench/serve.py --start --requests 4096 --llm-flag=--max-batch-tokens=8192
            step placement-emb 230 python3 bench/placement.py --layouts embeddings,shared
            tail -8 "$OUT/llm-table.log"; tail -36 "$OUT/placement-emb.log" ;;
        serve-once) step serve-once 170 env CUDA_VISIBLE_DEVICES=0 python3 bench/serve.py --start --requests 4096 ;;
        *) echo "unknown step $name"; exit 2 ;;
    esac
done
