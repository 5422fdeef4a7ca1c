#!/usr/bin/env bash
# Sets up .venv, generates the sample image folder (sample_data/flowers) and converts it
# with the DirectRunner to sample_output/flowers, then verifies the output.
# Extra arguments go to the pipeline (e.g. --format=tfrecord --image_size=224,224).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
toolkit_env "pipelines"
if [ ! -d sample_data/flowers ]; then
  .venv/bin/python scripts/make_sample_images.py sample_data/flowers \
    --classes=daisy,rose,tulip --splits=train,validation --per_class=40 --corrupt=3
fi
.venv/bin/python -m pipelines.image_folder --input=sample_data/flowers --output=sample_output/flowers \
  --runner=DirectRunner --overwrite=true "$@"
.venv/bin/python -m formats.inspect sample_output/flowers --verify --grid sample_output/flowers-grid.png
