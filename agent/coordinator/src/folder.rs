//! The names in a coordinator's data folder, and its defaults.

pub const DEFAULT_DATA: &str = "/var/lib/octomy-coordinator";
pub const DEFAULT_PORT: u16 = 18426;
pub const KEY_FILE: &str = "coordinator.key";
pub const STORE_FILE: &str = "coordinator.redb";
/// Present in a data folder whose coordinator serves a PostgreSQL store (see
/// [`StoreLocation::mark`](crate::StoreLocation::mark)).
pub const POSTGRES_MARK: &str = "store-is-postgres";
