from hypothesis import HealthCheck, settings

# deadline off: mpmath at 50 digits and the Triton interpreter have uneven run times.
settings.register_profile("kvcert", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("kvcert")
