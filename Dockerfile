# Astro runtime image: Astro Runtime X.Y carries Apache Airflow X.Y. This bundle is pinned to
# Airflow 3.3.2 (requirements-airflow.txt, used for the local .venv); pick the 3.3 runtime patch
# whose `airflow version` prints 3.3.2 (check with: docker run --rm <image> airflow version)
# and keep tests/unit/test_project_files.py green when bumping either side.
FROM astrocrpublic.azurecr.io/runtime:3.3-3
