#!/usr/bin/env bash
# Build the worker/launcher container image and the Flex Template spec that points at it.
#
#   templates/build.sh [--dry-run] PROJECT REGION BUCKET IMAGE tpu|gpu [options]
#
#   PROJECT   Google Cloud project id
#   REGION    region of the Artifact Registry repository and of the jobs (e.g. us-central1)
#   BUCKET    bucket name (no gs://) that receives the template spec: gs://BUCKET/templates/flux2-klein-VARIANT.json
#   IMAGE     full image reference, e.g. us-central1-docker.pkg.dev/PROJECT/flux2/flux2-klein:tpu
#   tpu|gpu   image variant: jax[tpu] for TPU workers, jax[cuda13] for NVIDIA workers
#
# options:
#   --weights DIR|gs://URI   bake a diffusers-layout checkpoint into the image at /opt/flux2-klein/weights
#   --gpu-jax-extra EXTRA    cuda13 (default; NVIDIA driver >= 580) or cuda12 (driver >= 525)
#   --local-docker           build with the local Docker engine and push, instead of Cloud Build
#   --template GCS_PATH      where to write the template spec (default above)
#   --dry-run                print the commands instead of running them
#
# Needs: gcloud (authenticated, with the project's Cloud Build, Artifact Registry and Dataflow APIs enabled).
set -euo pipefail

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
case "${1:-}" in -h|--help) usage 0 ;; esac
[ "$#" -ge 5 ] || usage
PROJECT=$1 REGION=$2 BUCKET=${3#gs://} IMAGE=$4 VARIANT=$5
shift 5

WEIGHTS="" GPU_JAX_EXTRA=cuda13 LOCAL_DOCKER=0 TEMPLATE=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --weights) WEIGHTS=${2:?--weights needs a value}; shift 2 ;;
    --gpu-jax-extra) GPU_JAX_EXTRA=${2:?--gpu-jax-extra needs a value}; shift 2 ;;
    --local-docker) LOCAL_DOCKER=1; shift ;;
    --template) TEMPLATE=${2:?--template needs a value}; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    *) echo "build.sh: unknown option $1" >&2; usage ;;
  esac
done

case "$VARIANT" in tpu|gpu) ;; *) echo "build.sh: variant must be tpu or gpu, got '$VARIANT'" >&2; exit 2 ;; esac
case "$GPU_JAX_EXTRA" in cuda12|cuda13) ;; *) echo "build.sh: --gpu-jax-extra must be cuda12 or cuda13" >&2; exit 2 ;; esac
case "$IMAGE" in *[[:space:]]*|"") echo "build.sh: bad image reference '$IMAGE'" >&2; exit 2 ;; esac
TEMPLATE=${TEMPLATE:-gs://$BUCKET/templates/flux2-klein-$VARIANT.json}

run() {
  if [ "$DRY_RUN" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)

# Stage a small build context: only what the image needs (no virtualenv, outputs or caches).
CTX=$(mktemp -d "${TMPDIR:-/tmp}/flux2-klein-build.XXXXXX")
trap 'rm -rf "$CTX"' EXIT
cp "$ROOT/setup.py" "$CTX/"
for pkg in model transforms pipeline benchmarks tiny_klein; do
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
  run docker build \
    --build-arg "ACCELERATOR=$VARIANT" \
    --build-arg "GPU_JAX_EXTRA=$GPU_JAX_EXTRA" \
    --tag "$IMAGE" "$CTX"
  run docker push "$IMAGE"
else
  run gcloud builds submit "$CTX" \
    --project "$PROJECT" \
    --config "$CTX/cloudbuild.yaml" \
    --substitutions "^~^_IMAGE=$IMAGE~_ACCELERATOR=$VARIANT~_GPU_JAX_EXTRA=$GPU_JAX_EXTRA~_WEIGHTS_URI=$WEIGHTS_URI"
fi

run gcloud dataflow flex-template build "$TEMPLATE" \
  --project "$PROJECT" \
  --image "$IMAGE" \
  --sdk-language PYTHON \
  --metadata-file "$HERE/metadata.json"

echo "Built $IMAGE ($VARIANT) and the template spec $TEMPLATE (region $REGION)." >&2
echo "Launch: templates/run.sh $PROJECT $REGION $BUCKET $IMAGE SETTINGS INPUT OUTPUT [MODEL]" >&2
