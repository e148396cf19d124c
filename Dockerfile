# Astro runtime image: Astro Runtime X.Y carries Apache Airflow X.Y. This bundle is pinned to
# Airflow 3.3.2 (requirements-airflow.txt, used for the local .venv); pick the 3.3 runtime patch
# whose `airflow version` prints 3.3.2 (check with: docker run --rm <image> airflow version)
# and keep tests/unit/test_project_files.py green when bumping either side.
FROM astrocrpublic.azurecr.io/runtime:3.3-3

# The scheduler-side distribution (deadline reference, deadline callback, alert delivery; an
# `airflow.plugins` entry point). The runtime's ONBUILD steps have installed requirements.txt and
# copied the project to /usr/local/airflow by now. The scheduler, dag-processor, API server and
# triggerer import it from site-packages; the DAGs and job code run from the DAG bundle (the
# copy in dags/ + include/ here, or a GitDagBundle checkout per run). See docs/deploying.md.
RUN pip install --no-cache-dir --no-deps /usr/local/airflow/scheduler_plugin
