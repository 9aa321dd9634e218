//! Where a function of a Go executable starts and which calls it makes, read from the
//! executable's `.gopclntab` (the table the Go runtime keeps for its own stack traces, there
//! in a stripped binary too): for the tests that stop a Go program (csi-sanity) at a given
//! instruction. x86-64 ELF, Go 1.18 and later.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

/// The functions of a Go executable and its machine code.
#[derive(Debug)]
pub struct GoBinary {
    data: Vec<u8>,
    /// `.text`: its address and its offset in the file.
    text_addr: u64,
    text_offset: u64,
    functions: HashMap<String, Range<u64>>,
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn usize_at(b: &[u8], at: usize) -> Option<usize> {
    usize::try_from(u64_at(b, at)?).ok()
}

/// An ELF section: address, file offset, size.
struct Section {
    addr: u64,
    offset: usize,
    size: usize,
}

/// The sections of an ELF64 file, by name.
fn sections(data: &[u8]) -> Option<HashMap<String, Section>> {
    if data.get(..4)? != b"\x7fELF" || *data.get(4)? != 2 {
        return None;
    }
    let shoff = usize_at(data, 0x28)?;
    let entsize = usize::from(u16_at(data, 0x3a)?);
    let count = usize::from(u16_at(data, 0x3c)?);
    let names_index = usize::from(u16_at(data, 0x3e)?);
    let header = |i: usize| shoff + i * entsize;
    let names = usize_at(data, header(names_index) + 24)?;
    let mut out = HashMap::new();
    for i in 0..count {
        let h = header(i);
        let name_at = names + usize::try_from(u32_at(data, h)?).ok()?;
        let len = data.get(name_at..)?.iter().position(|&c| c == 0)?;
        let name = String::from_utf8_lossy(data.get(name_at..name_at + len)?).into_owned();
        let section = Section {
            addr: u64_at(data, h + 16)?,
            offset: usize_at(data, h + 24)?,
            size: usize_at(data, h + 32)?,
        };
        out.insert(name, section);
    }
    Some(out)
}

/// Every function in a `.gopclntab` whose text starts at `text_start`: name to address range.
fn functions(tab: &[u8], text_start: u64) -> Option<HashMap<String, Range<u64>>> {
    let magic = u32_at(tab, 0)?;
    // Go 1.18-1.19 and 1.20 on: the same layout.
    if magic != 0xffff_fff0 && magic != 0xffff_fff1 || *tab.get(7)? != 8 {
        return None;
    }
    let nfunc = usize_at(tab, 8)?;
    let header_start = u64_at(tab, 24)?;
    let start = if header_start == 0 {
        text_start
    } else {
        header_start
    };
    let names = usize_at(tab, 32)?;
    let pcln = usize_at(tab, 64)?;
    let mut out = HashMap::with_capacity(nfunc);
    for i in 0..nfunc {
        let entry = u64::from(u32_at(tab, pcln + 8 * i)?);
        let func = pcln + usize::try_from(u32_at(tab, pcln + 8 * i + 4)?).ok()?;
        let next = u64::from(u32_at(tab, pcln + 8 * (i + 1))?);
        let name_at = names + usize::try_from(u32_at(tab, func + 4)?).ok()?;
        let len = tab.get(name_at..)?.iter().position(|&c| c == 0)?;
        let name = String::from_utf8_lossy(tab.get(name_at..name_at + len)?).into_owned();
        out.insert(name, start + entry..start + next);
    }
    Some(out)
}

impl GoBinary {
    /// Reads the executable at `path`; an error says why it is not an x86-64 Go executable
    /// whose table this reads.
    pub fn load(path: &Path) -> Result<Self, String> {
        let data = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let not = |what: &str| format!("{}: {what}", path.display());
        let secs = sections(&data).ok_or_else(|| not("not an ELF64 file"))?;
        let text = secs.get(".text").ok_or_else(|| not("no .text"))?;
        let tab = secs
            .get(".gopclntab")
            .ok_or_else(|| not("no .gopclntab (not a Go executable)"))?;
        let tab_bytes = data
            .get(tab.offset..tab.offset + tab.size)
            .ok_or_else(|| not(".gopclntab out of the file"))?;
        let functions = functions(tab_bytes, text.addr)
            .ok_or_else(|| not("a .gopclntab this reader does not know"))?;
        Ok(Self {
            text_addr: text.addr,
            text_offset: text.offset as u64,
            functions,
            data,
        })
    }

    /// The addresses of the function named `name` (Go's full name, e.g.
    /// `google.golang.org/grpc.DialContext`).
    pub fn function(&self, name: &str) -> Option<Range<u64>> {
        self.functions.get(name).cloned()
    }

    /// The return addresses of the direct calls (`call rel32`) that `caller` makes to
    /// `callee`: where the caller goes on once the callee returns.
    pub fn returns_from_calls(&self, caller: &str, callee: &str) -> Vec<u64> {
        let (Some(code), Some(target)) = (self.function(caller), self.function(callee)) else {
            return Vec::new();
        };
        let offset = |addr: u64| usize::try_from(addr - self.text_addr + self.text_offset).ok();
        let (Some(from), Some(to)) = (offset(code.start), offset(code.end)) else {
            return Vec::new();
        };
        let Some(bytes) = self.data.get(from..to) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, window) in bytes.windows(5).enumerate() {
            if window[0] != 0xe8 {
                continue;
            }
            let rel = i32::from_le_bytes([window[1], window[2], window[3], window[4]]);
            let after = code.start + i as u64 + 5;
            if after.checked_add_signed(i64::from(rel)) == Some(target.start) {
                out.push(after);
            }
        }
        out
    }
}
