# Custom Dataflow worker container: the Beam SDK image of the pinned version with the
# toolkit and every pixel decoder preinstalled, for fast, reproducible worker start-up
# and for workers without internet access.
#
#   docker build -t REGION-docker.pkg.dev/PROJECT/REPO/tpu-shards:0.1.0 .
#   docker push REGION-docker.pkg.dev/PROJECT/REPO/tpu-shards:0.1.0
#   python -m pipelines.ct_volumes ... --runner=DataflowRunner \
#       --sdk_container_image=REGION-docker.pkg.dev/PROJECT/REPO/tpu-shards:0.1.0 --sdk_location=container
#
# The Beam version here must equal the launcher's (constraints.txt: apache-beam==2.77.0).
FROM apache/beam_python3.11_sdk:2.77.0

WORKDIR /opt/tpu-shards
COPY pyproject.toml constraints.txt README.md ./
COPY formats ./formats
COPY pipelines ./pipelines
COPY loaders ./loaders
COPY scheduling ./scheduling
RUN pip install --no-cache-dir -c constraints.txt ".[pipelines]" \
 && python -c "from pipelines import registry; registry.check()"  # every converter and its workers' modules import

# The Beam SDK harness stays the entry point.
ENTRYPOINT ["/opt/apache/beam/boot"]
