#!/usr/bin/env bash
# Launch a FLUX.2 [klein] batch job from the Flex Template; returns once Dataflow has accepted the job.
#
#   templates/run.sh [--dry-run] PROJECT REGION BUCKET IMAGE SETTINGS INPUT OUTPUT [MODEL] [-- GCLOUD_FLAGS...]
#
#   PROJECT    Google Cloud project id
#   REGION     Dataflow region (e.g. us-central1); TPU/GPU capacity must exist in one of its zones
#   BUCKET     bucket name (no gs://): template spec, staging and temp files live there
#   IMAGE      the image built by templates/build.sh for this settings' variant (tpu or gpu)
#   SETTINGS   worker settings name: tpu-v5e, tpu-v6e, gpu-l4, gpu-h100 (python3 templates/settings.py --list)
#   INPUT      gs:// prompts file or glob (.jsonl, .csv or .txt)
#   OUTPUT     gs:// folder for images/, manifest/, errors/ and summary.json
#   MODEL      checkpoint: gs:// folder (diffusers layout); default: the weights baked into the image
#   GCLOUD_FLAGS  passed through, e.g. --parameters=height=768 --worker-zone=us-central1-a --max-workers=16
#
# Needs: gcloud (authenticated) and python3 (3.8+, standard library only) to read the settings file.
set -euo pipefail

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
case "${1:-}" in -h|--help) usage 0 ;; esac
[ "$#" -ge 7 ] || usage
PROJECT=$1 REGION=$2 BUCKET=${3#gs://} IMAGE=$4 SETTINGS=$5 INPUT=$6 OUTPUT=$7
shift 7
MODEL=""
if [ "$#" -gt 0 ] && [ "$1" != "--" ]; then MODEL=$1; shift; fi
if [ "$#" -gt 0 ]; then
  [ "$1" = "--" ] || { echo "run.sh: extra gcloud flags go after --" >&2; usage; }
  shift
fi
EXTRA=("$@")

for uri in "$INPUT" "$OUTPUT"; do
  case "$uri" in gs://?*) ;; *) echo "run.sh: INPUT and OUTPUT must be gs:// locations, got '$uri'" >&2; exit 2 ;; esac
done

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}

# The settings file decides the image variant (and so the template spec) and the worker flags.
VARIANT=$("$PYTHON" "$HERE/settings.py" "$SETTINGS" --format variant)
FLAGS_TEXT=$("$PYTHON" "$HERE/settings.py" "$SETTINGS" --image "$IMAGE" --format gcloud)
SETTINGS_FLAGS=()
while IFS= read -r line; do
  [ -n "$line" ] && SETTINGS_FLAGS+=("$line")
done <<< "$FLAGS_TEXT"

# A flag in GCLOUD_FLAGS replaces the settings' flag of the same name (or the same --parameters key), so
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

TEMPLATE="gs://$BUCKET/templates/flux2-klein-$VARIANT.json"
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
if [ "${#EXTRA[@]}" -gt 0 ]; then CMD+=("${EXTRA[@]}"); fi

if [ "$DRY_RUN" = 1 ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
"${CMD[@]}"
echo "Submitted $JOB_NAME. Watch it:" >&2
echo "  gcloud dataflow jobs list --project $PROJECT --region $REGION --filter=name=$JOB_NAME" >&2
echo "  https://console.cloud.google.com/dataflow/jobs?project=$PROJECT" >&2
