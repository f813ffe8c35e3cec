//! OCI image layouts, reproducible layers and registry transfers. Knows nothing of fleets.
