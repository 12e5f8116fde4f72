#!/usr/bin/env bash
# Launch a FLUX.2 [klein] batch job from the Flex Template; returns once Dataflow has accepted the job.
#
#   templates/run.sh [--dry-run] [--use-reservation] [--skip-preflight] [--template GCS_PATH] \
#       PROJECT REGION BUCKET IMAGE SETTINGS INPUT OUTPUT [MODEL] [-- GCLOUD_FLAGS...]
#
#   PROJECT    Google Cloud project id
#   REGION     Dataflow region (e.g. us-central1); TPU/GPU capacity must exist in one of its zones
#   BUCKET     bucket name (no gs://): template spec, staging and temp files live there
#   IMAGE      the worker image templates/build.sh printed (IMAGE:VARIANT-YYYYMMDD-HHMMSS), or IMAGE@sha256:...
#              with --template; the template spec of the same build is gs://BUCKET/templates/flux2-klein-TAG.json
#   SETTINGS   worker settings name, e.g. tpu-v5e, tpu-v6e-2x2, gpu-l4 (python3 templates/settings.py --list)
#   INPUT      gs:// prompts file or glob (.jsonl, .csv or .txt)
#   OUTPUT     gs:// folder for images/, manifest/, errors/ and summary.json
#   MODEL      checkpoint: gs:// folder (diffusers layout); default: the weights baked into the image
#   GCLOUD_FLAGS  passed through, e.g. --parameters=height=768 --worker-zone=us-central1-a --max-workers=16;
#              --additional-experiments=OPTION adds Dataflow service options to the settings' accelerator one
#
#   --use-reservation  consume matching Compute Engine reservations (service option
#                      automatically_use_created_reservation); pair it with --worker-zone=ZONE of the reservation
#   --skip-preflight   TPU settings: launch without the launcher first compiling the job for the workers' chips
#                      (by default a job whose programs exceed the chips' HBM is refused before any worker starts)
#   --template         the template spec to launch (default: the one build.sh wrote for IMAGE's tag)
#
# TPU settings (without --skip-preflight) launch on a launcher VM of LAUNCHER_MACHINE_TYPE (default e2-standard-4)
# with a LAUNCHER_TIMEOUT_S (default 1800) s launch timeout: a launch whose preflight answer is not stored compiles
# the job there (minutes, over 5 GB of memory for klein-4B int8), which Dataflow's default n1-standard-1 cannot hold.
# GCLOUD_FLAGS --launcher-machine-type=... or --launcher-vm-timeout-secs=... replace them.
#
# Needs: gcloud (authenticated) and python3 (3.8+, standard library only) to read the settings file.
set -euo pipefail

usage() { sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//' >&2; exit "${1:-2}"; }

DRY_RUN=0 USE_RESERVATION=0 SKIP_PREFLIGHT=0 TEMPLATE=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --use-reservation) USE_RESERVATION=1; shift ;;
    --skip-preflight) SKIP_PREFLIGHT=1; shift ;;
    --template) TEMPLATE=${2:?--template needs a value}; shift 2 ;;
    -h|--help) usage 0 ;;
    *) break ;;
  esac
done
[ "$#" -ge 7 ] || usage
PROJECT=$1 REGION=$2 BUCKET=${3#gs://} IMAGE=$4 SETTINGS=$5 INPUT=$6 OUTPUT=$7
shift 7
MODEL=""
if [ "$#" -gt 0 ] && [ "$1" != "--" ]; then MODEL=$1; shift; fi
if [ "$#" -gt 0 ]; then
  [ "$1" = "--" ] || { echo "run.sh: extra gcloud flags go after --" >&2; usage; }
  shift
fi

# Service options the caller adds join the settings' accelerator option in one --additional-experiments flag
# (the documented way for Flex Templates), so none of them can replace or drop it. The worker zone fills in the
# settings' ${ZONE}.
EXTRA=() SERVICE_OPTIONS=() ZONE=""
for flag in "$@"; do
  case "$flag" in
    --additional-experiments=*)
      IFS=, read -r -a opts <<< "${flag#--additional-experiments=}"
      SERVICE_OPTIONS+=("${opts[@]}") ;;
    --additional-experiments|--worker-zone)
      echo "run.sh: write $flag=VALUE (one argument)" >&2; exit 2 ;;
    --parameters=dataflow_service_options=*|--parameters=^*^dataflow_service_options=*)
      echo "run.sh: pass service options as --additional-experiments=OPTION (Dataflow's way for Flex Templates)," \
        "not as a template parameter" >&2; exit 2 ;;
    --worker-zone=*) ZONE=${flag#--worker-zone=}; EXTRA+=("$flag") ;;
    *) EXTRA+=("$flag") ;;
  esac
done

for uri in "$INPUT" "$OUTPUT"; do
  case "$uri" in gs://?*) ;; *) echo "run.sh: INPUT and OUTPUT must be gs:// locations, got '$uri'" >&2; exit 2 ;; esac
done

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}

# The settings file decides the worker flags; settings.py also rejects an image of the other variant or one that
# names no build, and finds the build's template spec.
SETTINGS_ARGS=("$SETTINGS" --image "$IMAGE" --project "$PROJECT")
if [ -n "$ZONE" ]; then SETTINGS_ARGS+=(--zone "$ZONE"); fi
if [ "$USE_RESERVATION" = 1 ]; then SETTINGS_ARGS+=(--use-reservation); fi
for option in "${SERVICE_OPTIONS[@]+"${SERVICE_OPTIONS[@]}"}"; do SETTINGS_ARGS+=(--service-option "$option"); done
FLAGS_TEXT=$("$PYTHON" "$HERE/settings.py" "${SETTINGS_ARGS[@]}" --format gcloud)
if [ -z "$TEMPLATE" ]; then
  TEMPLATE=$("$PYTHON" "$HERE/settings.py" "${SETTINGS_ARGS[@]}" --bucket "$BUCKET" --format template)
fi
SETTINGS_FLAGS=()
while IFS= read -r line; do
  [ -n "$line" ] && SETTINGS_FLAGS+=("$line")
done <<< "$FLAGS_TEXT"

# Any other flag in GCLOUD_FLAGS replaces the settings' flag of the same name (or the same --parameters key), so
# `-- --max-workers=16` or `-- --parameters=disk_size_gb=300` override the settings file.
flag_key() {  # --max-workers=4 -> --max-workers ; --parameters=^~^a=1 or --parameters=a=1 -> --parameters=a
  local f=${1#--parameters=}
  if [ "$f" != "$1" ]; then f=${f#^~^}; printf -- '--parameters=%s' "${f%%=*}"; else printf -- '%s' "${1%%=*}"; fi
}
KEPT=()
for flag in "${SETTINGS_FLAGS[@]}"; do
  key=$(flag_key "$flag") overridden=0
  for extra in "${EXTRA[@]+"${EXTRA[@]}"}"; do
    if [ "$(flag_key "$extra")" = "$key" ]; then overridden=1; fi
  done
  if [ "$overridden" = 0 ]; then KEPT+=("$flag"); fi
done

JOB_NAME="flux2-klein-$SETTINGS-$(date -u +%Y%m%d-%H%M%S)"

param() {  # one --parameters flag; values with commas use gcloud's alternate delimiter
  case "$2" in *,*) printf -- '--parameters=^~^%s=%s' "$1" "$2" ;; *) printf -- '--parameters=%s=%s' "$1" "$2" ;; esac
}

CMD=(gcloud dataflow flex-template run "$JOB_NAME"
  --project "$PROJECT"
  --region "$REGION"
  --template-file-gcs-location "$TEMPLATE"
  --staging-location "gs://$BUCKET/staging"
  --temp-location "gs://$BUCKET/temp"
  "$(param input "$INPUT")"
  "$(param output "$OUTPUT")"
  "${KEPT[@]}")
if [ -n "$MODEL" ]; then CMD+=("$(param model "$MODEL")"); fi
# A TPU job's launcher runs its preflight: sized for one that must compile (see above), unless the caller sizes it.
VARIANT=$("$PYTHON" "$HERE/settings.py" "$SETTINGS" --format variant)
if [ "$VARIANT" = tpu ] && [ "$SKIP_PREFLIGHT" = 0 ]; then
  LAUNCHER=("--launcher-machine-type=${LAUNCHER_MACHINE_TYPE:-e2-standard-4}"
    "--launcher-vm-timeout-secs=${LAUNCHER_TIMEOUT_S:-1800}")
  for i in "${!LAUNCHER[@]}"; do
    given=0
    for extra in "${EXTRA[@]+"${EXTRA[@]}"}"; do
      if [ "${extra%%=*}" = "${LAUNCHER[$i]%%=*}" ]; then given=1; LAUNCHER[i]=$extra; fi
    done
    if [ "$given" = 0 ]; then CMD+=("${LAUNCHER[$i]}"); fi
  done
  echo "run.sh: TPU launcher ${LAUNCHER[0]#*=}, launch timeout ${LAUNCHER[1]#*=} s (room to compile the preflight" \
    "should no stored answer match; build.sh compiles ahead so a matching launch compiles nothing)" >&2
fi
if [ "$SKIP_PREFLIGHT" = 1 ]; then CMD+=("$(param skip_preflight true)"); fi
if [ "${#EXTRA[@]}" -gt 0 ]; then CMD+=("${EXTRA[@]}"); fi

if [ "$DRY_RUN" = 1 ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
"${CMD[@]}"
echo "Submitted $JOB_NAME. Watch it:" >&2
echo "  gcloud dataflow jobs list --project $PROJECT --region $REGION --filter=name=$JOB_NAME" >&2
echo "  https://console.cloud.google.com/dataflow/jobs?project=$PROJECT" >&2
