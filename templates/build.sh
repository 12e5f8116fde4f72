#!/usr/bin/env bash
# Build the two container images of one build (the SDK worker image and the slim Flex Template launcher image) and
# the Flex Template spec that points at them. Prints the worker image reference (IMAGE:TAG) on stdout, everything
# else on stderr, so that `TPU_IMAGE=$(templates/build.sh ...)` keeps it for templates/run.sh.
#
#   templates/build.sh [--dry-run] PROJECT REGION BUCKET IMAGE tpu|gpu [options]
#
#   PROJECT   Google Cloud project id
#   REGION    region of the Artifact Registry repository and of the jobs (e.g. us-central1)
#   BUCKET    bucket name (no gs://) that receives the template spec: gs://BUCKET/templates/flux2-klein-TAG.json
#   IMAGE     image name without a tag, e.g. us-central1-docker.pkg.dev/PROJECT/flux2/flux2-klein; the build pushes
#             IMAGE:TAG (worker) and IMAGE-launcher:TAG (launcher), TAG new for every build (VARIANT-YYYYMMDD-HHMMSS)
#   tpu|gpu   image variant: jax[tpu] for TPU workers, jax[cuda12] for NVIDIA workers
#
# options:
#   --weights DIR|gs://URI   bake a diffusers-layout checkpoint into the worker image at /opt/flux2-klein/weights
#                            (the launcher image gets only its JSON configs)
#   --gpu-jax-extra EXTRA    cuda12 (default; NVIDIA driver 525.60.13+) or cuda13 (driver 580+, not documented
#                            for Dataflow's install-nvidia-driver)
#   --tag TAG                this build's tag (default VARIANT-<UTC time>); must start with VARIANT-
#   --local-docker           build with the local Docker engine (BuildKit) and push, instead of Cloud Build
#   --template GCS_PATH      where to write the template spec (default above)
#   --compile-ahead NAMES    tpu builds with --weights: the TPU settings (comma-separated) whose default job is
#                            compiled ahead in the new launcher image (default: every tpu-* settings file); their
#                            programs and preflight answers go to gs://BUCKET/temp/flux2-klein-xla-cache, so a launch
#                            of those settings with the baked weights compiles nothing
#   --no-compile-ahead       skip that step (a launch then compiles on its launcher; run.sh sizes it for that)
#   --dry-run                print the commands (on stderr) instead of running them
#
# Needs: gcloud (authenticated, with the project's Cloud Build, Artifact Registry and Dataflow APIs enabled).
set -euo pipefail

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//' >&2; exit "${1:-2}"; }

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
case "${1:-}" in -h|--help) usage 0 ;; esac
[ "$#" -ge 5 ] || usage
PROJECT=$1 REGION=$2 BUCKET=${3#gs://} IMAGE=$4 VARIANT=$5
shift 5

WEIGHTS="" GPU_JAX_EXTRA=cuda12 LOCAL_DOCKER=0 TEMPLATE="" TAG="" COMPILE_AHEAD=all
while [ "$#" -gt 0 ]; do
  case "$1" in
    --weights) WEIGHTS=${2:?--weights needs a value}; shift 2 ;;
    --gpu-jax-extra) GPU_JAX_EXTRA=${2:?--gpu-jax-extra needs a value}; shift 2 ;;
    --tag) TAG=${2:?--tag needs a value}; shift 2 ;;
    --local-docker) LOCAL_DOCKER=1; shift ;;
    --template) TEMPLATE=${2:?--template needs a value}; shift 2 ;;
    --compile-ahead) COMPILE_AHEAD=${2:?--compile-ahead needs a value}; shift 2 ;;
    --no-compile-ahead) COMPILE_AHEAD=none; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    *) echo "build.sh: unknown option $1" >&2; usage ;;
  esac
done

case "$VARIANT" in tpu|gpu) ;; *) echo "build.sh: variant must be tpu or gpu, got '$VARIANT'" >&2; exit 2 ;; esac
case "$GPU_JAX_EXTRA" in cuda12|cuda13) ;; *) echo "build.sh: --gpu-jax-extra must be cuda12 or cuda13" >&2; exit 2 ;; esac
case "$IMAGE" in *[[:space:]]*|"") echo "build.sh: bad image name '$IMAGE'" >&2; exit 2 ;; esac
case "${IMAGE##*/}" in
  *:*|*@*) echo "build.sh: give IMAGE without a tag or digest, got '$IMAGE': every build gets its own tag" >&2
           exit 2 ;;
esac
# A tag per build, never reused: a running job keeps the images it started with whatever is built later.
TAG=${TAG:-$VARIANT-$(date -u +%Y%m%d-%H%M%S)}
case "$TAG" in
  "$VARIANT"-*) ;;
  *) echo "build.sh: --tag must start with $VARIANT- (run.sh checks it against the settings), got '$TAG'" >&2; exit 2 ;;
esac
if ! [[ "$TAG" =~ ^[A-Za-z0-9_][-A-Za-z0-9_.]{0,127}$ ]]; then
  echo "build.sh: '$TAG' is not a valid image tag" >&2; exit 2
fi
WORKER_IMAGE="$IMAGE:$TAG"
LAUNCHER_IMAGE="$IMAGE-launcher:$TAG"
TEMPLATE=${TEMPLATE:-gs://$BUCKET/templates/flux2-klein-$TAG.json}

run() {  # stdout is kept for the image reference: commands and their output go to stderr
  if [ "$DRY_RUN" = 1 ]; then printf '%q ' "$@" >&2; echo >&2; else "$@" >&2; fi
}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)

# Stage a small build context: only what the image needs (no virtualenv, outputs or caches).
CTX=$(mktemp -d "${TMPDIR:-/tmp}/flux2-klein-build.XXXXXX")
trap 'rm -rf "$CTX"' EXIT
cp "$ROOT/setup.py" "$CTX/"
for pkg in model transforms pipeline tiny_klein; do
  mkdir -p "$CTX/$pkg"
  if [ -d "$ROOT/$pkg" ]; then
    (cd "$ROOT" && tar --exclude='__pycache__' --exclude='*.pyc' -cf - "$pkg") | tar -C "$CTX" -xf -
  fi
done
cp "$HERE/main.py" "$CTX/main.py"
cp "$HERE/Dockerfile" "$CTX/Dockerfile"
cp "$HERE/cloudbuild.yaml" "$CTX/cloudbuild.yaml"
mkdir -p "$CTX/weights"

WEIGHTS_URI=""
case "$WEIGHTS" in
  "") ;;
  gs://*) WEIGHTS_URI=$WEIGHTS ;;
  *) [ -f "$WEIGHTS/model_index.json" ] || { echo "build.sh: $WEIGHTS has no model_index.json" >&2; exit 2; }
     cp -R "$WEIGHTS/." "$CTX/weights/" ;;
esac

if [ "$LOCAL_DOCKER" = 1 ]; then
  if [ -n "$WEIGHTS_URI" ]; then run gcloud storage rsync --recursive "$WEIGHTS_URI" "$CTX/weights"; fi
  run env DOCKER_BUILDKIT=1 docker build --target launcher --tag "$LAUNCHER_IMAGE" "$CTX"
  run env DOCKER_BUILDKIT=1 docker build --target worker \
    --build-arg "ACCELERATOR=$VARIANT" \
    --build-arg "GPU_JAX_EXTRA=$GPU_JAX_EXTRA" \
    --tag "$WORKER_IMAGE" "$CTX"
  run docker push "$LAUNCHER_IMAGE"
  run docker push "$WORKER_IMAGE"
else
  run gcloud builds submit "$CTX" \
    --project "$PROJECT" \
    --config "$CTX/cloudbuild.yaml" \
    --substitutions "^~^_IMAGE=$WORKER_IMAGE~_LAUNCHER_IMAGE=$LAUNCHER_IMAGE~_ACCELERATOR=$VARIANT~_GPU_JAX_EXTRA=$GPU_JAX_EXTRA~_WEIGHTS_URI=$WEIGHTS_URI"
fi

# The spec names the launcher image; the worker image travels with each launch (sdk_container_image).
run gcloud dataflow flex-template build "$TEMPLATE" \
  --project "$PROJECT" \
  --image "$LAUNCHER_IMAGE" \
  --sdk-language PYTHON \
  --metadata-file "$HERE/metadata.json"

# Compile ahead (tpu builds with baked-in weights): each TPU settings file's default job through the launch's own
# TPU preflight, in the launcher image just built (its jax, libtpu and code are a launch's), so its programs and its
# answer are in the jobs' shared compilation cache before the first launch (templates/compile_ahead_steps.py).
if [ "$VARIANT" = tpu ] && [ "$COMPILE_AHEAD" != none ] && [ -n "$WEIGHTS" ]; then
  PYTHON=${PYTHON:-python3}
  AHEAD_ARGS=(--launcher-image "$LAUNCHER_IMAGE" --worker-image "$WORKER_IMAGE" --project "$PROJECT"
    --region "$REGION" --bucket "$BUCKET")
  if [ "$COMPILE_AHEAD" != all ]; then AHEAD_ARGS+=(--settings "$COMPILE_AHEAD"); fi
  if [ "$LOCAL_DOCKER" = 1 ]; then
    while IFS= read -r line; do
      [ -n "$line" ] && run bash -c "$line"
    done < <("$PYTHON" "$HERE/compile_ahead_steps.py" "${AHEAD_ARGS[@]}" --format docker)
  else
    "$PYTHON" "$HERE/compile_ahead_steps.py" "${AHEAD_ARGS[@]}" --format cloudbuild > "$CTX/compile-ahead.json"
    run gcloud builds submit --no-source --project "$PROJECT" --config "$CTX/compile-ahead.json"
  fi
elif [ "$VARIANT" = tpu ] && [ "$COMPILE_AHEAD" != none ]; then
  echo "No --weights: the TPU jobs' preflight is not compiled ahead (a launch compiles it, on the launcher" \
    "templates/run.sh sizes for that)." >&2
fi

if [ "$DRY_RUN" = 1 ]; then
  echo "Dry run: nothing was built or pushed; the commands above would build $WORKER_IMAGE (worker, $VARIANT)," \
    "$LAUNCHER_IMAGE (launcher) and the template spec $TEMPLATE (region $REGION)." >&2
else
  echo "Built $WORKER_IMAGE (worker, $VARIANT), $LAUNCHER_IMAGE (launcher) and the template spec $TEMPLATE" \
    "(region $REGION)." >&2
  echo "Launch: templates/run.sh $PROJECT $REGION $BUCKET $WORKER_IMAGE SETTINGS INPUT OUTPUT [MODEL]" >&2
fi
echo "$WORKER_IMAGE"
