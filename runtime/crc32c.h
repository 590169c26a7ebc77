/* CRC-32C (Castagnoli), the checksum that seals every frame between nodes (runtime/msg.h). */
#ifndef SH_RUNTIME_CRC32C_H
#define SH_RUNTIME_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Continues a CRC-32C over `len` bytes at `p`: pass 0 to start, the previous result to go on
 * (crc(a || b) == sh__crc32c(sh__crc32c(0, a), b)). The standard CRC-32C: reflected polynomial
 * 0x82f63b78, initial value and final xor ~0, so sh__crc32c(0, "123456789", 9) == 0xe3069283.
 * On x86-64 (checked once, at the first call): carry-less multiplication (AVX-512 VPCLMULQDQ)
 * from 1 KiB where the CPU has it, else the SSE4.2 crc32 instruction; a table-driven slice-by-8
 * loop elsewhere; all give the same values. Any thread. */
uint32_t sh__crc32c(uint32_t crc, const void *p, size_t len);

/* The portable table-driven version (for tests and benchmarks to compare with). */
uint32_t sh__crc32c_sw(uint32_t crc, const void *p, size_t len);

/* sh__crc32c without the carry-less multiplication (the crc32 instruction where the CPU has it,
 * else the tables), for the tests to compare with. */
uint32_t sh__crc32c_insn(uint32_t crc, const void *p, size_t len);

/* 0: sh__crc32c uses the tables; 1: the crc32 instruction; 2: the instruction, and carry-less
 * multiplication from 1 KiB. */
int sh__crc32c_hw(void);

#endif
