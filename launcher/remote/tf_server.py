"""A TensorFlow server for the task that TF_CONFIG names (``dtrain ps --builtin-servers``).

Workers and ps tasks of a ParameterServerStrategy job only need to serve:
dtrain runs this (as ``python -c`` text, so remote hosts need only
TensorFlow) and the user writes just the chief's coordinator program.
"""


def main() -> None:
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol=resolver.rpc_layer or "grpc",
        start=True,
    )
    print(f"dtrain tf_server: {resolver.task_type}:{resolver.task_id} serving", flush=True)
    server.join()


if __name__ == "__main__":
    main()
