#!/usr/bin/env bash
# Sets up .venv, generates the sample image folder (sample_data/flowers) and converts it
# with the DirectRunner to sample_output/flowers, then verifies the output. Then the same
# for a generated tree of DICOM CT series (sample_data/dicom -> sample_output/ct_volumes).
# Extra arguments go to the image pipeline (e.g. --format=tfrecord --image_size=224,224).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
toolkit_env "pipelines,sample"
if [ ! -d sample_data/flowers ]; then
  .venv/bin/python scripts/make_sample_images.py sample_data/flowers \
    --classes=daisy,rose,tulip --splits=train,validation --per_class=40 --corrupt=3
fi
.venv/bin/python -m pipelines.image_folder --input=sample_data/flowers --output=sample_output/flowers \
  --runner=DirectRunner --overwrite=true "$@"
.venv/bin/python -m formats.outputs.inspect sample_output/flowers --verify --grid sample_output/flowers-grid.png

if [ ! -d sample_data/dicom ]; then
  .venv/bin/python scripts/make_sample_ct.py sample_data/dicom
fi
.venv/bin/python -m pipelines.ct_volumes --input=sample_data/dicom --output=sample_output/ct_volumes \
  --id_salt=sample-salt --runner=DirectRunner --overwrite=true
.venv/bin/python -m formats.outputs.inspect sample_output/ct_volumes --verify --grid sample_output/ct_volumes-grid.png
