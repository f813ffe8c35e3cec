//! Stand-ins for GPUs that are not on the test machine: kernel report trees (`/sys`) laid out in
//! the shape real ones have, for the agent's `--sysfs-root`. Each card is a PCI device under
//! `devices/pci0000:00/...` with its `vendor`, `device` and `class` files, its `driver` link into
//! `bus/pci/drivers`, its `drm/cardN` and `drm/renderDM` folders, and the `class/drm/cardN` link
//! pointing at it; AMD's cards add `mem_info_vram_total` (and `product_name` and `unique_id`
//! where the driver has them: the Instinct cards) and a KFD topology node with their
//! `gfx_target_version` and render minor. The values are those the named cards report.
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// One card as the kernel reports it.
pub struct Card {
    /// `cardN`'s number; its render node is `renderD(128 + N)`.
    pub number: u32,
    /// The PCI address, and the bridges above it (root port first).
    pub address: &'static str,
    pub bridges: &'static [&'static str],
    pub vendor: &'static str,
    pub device: &'static str,
    pub class: &'static str,
    pub driver: &'static str,
    /// File name and text of the driver's own reports (`mem_info_vram_total`, ...).
    pub reports: &'static [(&'static str, &'static str)],
    /// AMD's KFD `gfx_target_version`, where the card has a KFD node.
    pub gfx_target_version: Option<u32>,
}

/// AMD Radeon RX 9070 XT (Navi 48, gfx1201): 16 GiB, no product name from the driver.
pub const RX_9070: Card = Card {
    number: 1,
    address: "0000:03:00.0",
    bridges: &["0000:00:01.1", "0000:01:00.0", "0000:02:00.0"],
    vendor: "0x1002",
    device: "0x7550",
    class: "0x030000",
    driver: "amdgpu",
    reports: &[("mem_info_vram_total", "17163091968")],
    gfx_target_version: Some(120001),
};

/// AMD Instinct MI300X (gfx942): 192 GiB, a processing accelerator (class 0x1200) that names
/// itself from its FRU.
pub const MI300X: Card = Card {
    number: 2,
    address: "0000:05:00.0",
    bridges: &["0000:00:03.1", "0000:04:00.0"],
    vendor: "0x1002",
    device: "0x74a1",
    class: "0x120000",
    driver: "amdgpu",
    reports: &[
        ("mem_info_vram_total", "206141652992"),
        ("product_name", "AMD Instinct MI300X OAM"),
        ("unique_id", "8a0b5c3e9f4d2c71"),
    ],
    gfx_target_version: Some(90402),
};

/// Intel Arc A770 (DG2) on i915, which reports no memory size of its own.
pub const ARC_A770: Card = Card {
    number: 3,
    address: "0000:07:00.0",
    bridges: &["0000:00:1c.0", "0000:06:00.0"],
    vendor: "0x8086",
    device: "0x56a0",
    class: "0x030000",
    driver: "i915",
    reports: &[],
    gfx_target_version: None,
};

/// A server's BMC display (ASPEED AST2600): a DRM card, but no accelerator.
pub const ASPEED_BMC: Card = Card {
    number: 0,
    address: "0000:09:00.0",
    bridges: &["0000:00:1c.4", "0000:08:00.0"],
    vendor: "0x1a03",
    device: "0x2000",
    class: "0x030000",
    driver: "ast",
    reports: &[],
    gfx_target_version: None,
};

/// A kernel report tree under `root`, holding `cards`.
pub fn tree(root: &Path, cards: &[&Card]) -> PathBuf {
    let topology = root.join("class/kfd/kfd/topology/nodes");
    // KFD's node 0 is the CPU: gfx_target_version 0.
    write(
        &topology.join("0/properties"),
        "cpu_cores_count 64\nsimd_count 0\ngfx_target_version 0\ndrm_render_minor 0\n",
    );
    for card in cards {
        add(root, card);
    }
    root.to_path_buf()
}

/// Adds one card to the tree at `root`.
pub fn add(root: &Path, card: &Card) {
    let mut device = root.join("devices/pci0000:00");
    for bridge in card.bridges {
        device = device.join(bridge);
    }
    let device = device.join(card.address);
    write(&device.join("vendor"), &format!("{}\n", card.vendor));
    write(&device.join("device"), &format!("{}\n", card.device));
    write(&device.join("class"), &format!("{}\n", card.class));
    for (name, text) in card.reports {
        write(&device.join(name), &format!("{text}\n"));
    }
    let drivers = root.join("bus/pci/drivers");
    std::fs::create_dir_all(drivers.join(card.driver)).expect("can make the driver folder");
    let depth = device
        .strip_prefix(root)
        .expect("under the root")
        .components()
        .count();
    let up = "../".repeat(depth);
    link(
        &format!("{up}bus/pci/drivers/{}", card.driver),
        &device.join("driver"),
    );
    let name = format!("card{}", card.number);
    let render = 128 + card.number;
    for node in [name.clone(), format!("renderD{render}")] {
        let dir = device.join("drm").join(&node);
        std::fs::create_dir_all(&dir).expect("can make the drm folder");
        link(&format!("../../../{}", card.address), &dir.join("device"));
    }
    let class = root.join("class/drm");
    std::fs::create_dir_all(&class).expect("can make class/drm");
    let target = device.join("drm").join(&name);
    let from_class = format!(
        "../../{}",
        target.strip_prefix(root).expect("under").display()
    );
    link(&from_class, &class.join(&name));
    if let Some(version) = card.gfx_target_version {
        let node = root.join(format!("class/kfd/kfd/topology/nodes/{}", card.number + 1));
        write(
            &node.join("properties"),
            &format!(
                "cpu_cores_count 0\nsimd_count 256\nmem_banks_count 1\ngfx_target_version {version}\nvendor_id {}\ndevice_id {}\ndrm_render_minor {render}\n",
                u32::from_str_radix(&card.vendor[2..], 16).unwrap_or(0),
                u32::from_str_radix(&card.device[2..], 16).unwrap_or(0),
            ),
        );
    }
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().expect("a parent")).expect("can make the folder");
    std::fs::write(path, text).expect("can write a report");
}

fn link(target: &str, at: &Path) {
    symlink(target, at).unwrap_or_else(|e| panic!("cannot link {} to {target}: {e}", at.display()));
}
