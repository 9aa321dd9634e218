//! The system calls both sides need, each once: the loop device ioctls (the controller attaches
//! with them, the node reads which file a loop device is bound to) and entering a private mount
//! namespace (moorctl's demo and the privileged tests).

pub mod loopdev;
pub mod mount_namespace;
