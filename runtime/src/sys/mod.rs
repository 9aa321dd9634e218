//! The system calls both sides need, each once: the loop device ioctls (the controller attaches
//! with them, the node reads which file a loop device is bound to), entering a private mount
//! namespace (moorctl's demo and the privileged tests), and the filesystem ioctls of the
//! controller's group snapshots and snapshot metadata (`fsctl`: freeze, thaw, FIEMAP).

pub mod fsctl;
pub mod loopdev;
pub mod mount_namespace;
