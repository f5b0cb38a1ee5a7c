# Source after benchmarks/gpu_env.sh on the GPU machine: installs the carried .whl/extra wheels
# (tensorboard and what it needs) that the image lacks, for `suite.py --log-cost` rows.
for pair in absl:absl_py grpc:grpcio markdown:markdown markupsafe:markupsafe google.protobuf:protobuf \
            tensorboard:tensorboard tensorboard_data_server:tensorboard_data_server; do
  module=${pair%%:*}; wheel=${pair##*:}
  python3 -c "import $module" 2>/dev/null && continue
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/extra/${wheel}-*.whl || echo "extra $wheel: install failed"
done
python3 -c "import tensorboard; print('tensorboard', tensorboard.__version__)"
