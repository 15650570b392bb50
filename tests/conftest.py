import cpu_env

# 8 emulated CPU devices for every CPU test, XLA set to compile fast; before jax is imported.
cpu_env.apply()
