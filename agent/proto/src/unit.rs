//! The agent's systemd unit as both sides know it: the coordinator's user data writes it, the
//! agent disables it when the fleet retires the machine.

/// The unit's name.
pub const UNIT_NAME: &str = "fleet-agent.service";
/// Where the bootstrap unpacks the bundle, and the agent installs its releases.
pub const INSTALL_DIR: &str = "/opt/octomy";
/// Where the user data writes it.
pub const UNIT_PATH: &str = "/etc/systemd/system/fleet-agent.service";
/// The agent's exit status once the fleet's operator retired or revoked the machine: the unit's
/// `RestartPreventExitStatus`, so systemd does not start it again (EX_CONFIG).
pub const ENDED_EXIT_STATUS: i32 = 78;
