#!/usr/bin/env bash
# Screenshots of the pages a person looks at, taken by the tests that check them in headless Chromium:
#   benchmarks/pages.sh
# Writes benchmarks/results/report.png (a real profile's report with the live loop's timeline) and
# benchmarks/results/status-page.png (the status page of a real `kvguard serve` after two requests).
set -euo pipefail
export KVGUARD_SCREENSHOTS=benchmarks/results
mkdir -p "$KVGUARD_SCREENSHOTS"
.venv/bin/python -m pytest -q -p no:cacheprovider \
    "tests/calibration/test_report.py::test_report_with_the_loops_timeline_renders_in_chromium" \
    "tests/serving/test_pages.py::test_status_page_renders_live_numbers_in_chromium"
