#!/bin/sh
echo "bazel coverage is not available in tf_gba's offline Bazel setup (no remote_coverage_tools)." >&2
exit 1
