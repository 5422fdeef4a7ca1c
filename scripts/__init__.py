"""Command-line programs and benchmarks; a package so that tests import the sample generators by name.

    from scripts import make_sample_images, make_sample_ct, make_sample_ogb

Each module still runs as a script (`python scripts/make_sample_images.py OUT_DIR`).
"""
