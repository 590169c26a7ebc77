/* Actor addresses: a node id and an actor id packed into one by-value 64-bit integer. */
#ifndef SHOAL_ADDR_H
#define SHOAL_ADDR_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An actor's address (DESIGN.md section 2): the node id in the high 32 bits, the actor id in the
 * low 32 bits. Addresses are values; they are compared with == and travel in every frame's
 * envelope as a msgpack unsigned integer. Zero is never a valid address (node 0, actor 0), so a
 * zeroed field reads as "no address". */
typedef uint64_t sh_addr;

#define SH_ADDR_NONE ((sh_addr)0)

/* The address of actor `actor` on node `node`. */
static inline sh_addr sh_addr_make(uint32_t node, uint32_t actor)
{
    return ((sh_addr)node << 32) | (sh_addr)actor;
}

/* The node id of an address. */
static inline uint32_t sh_addr_node(sh_addr a) { return (uint32_t)(a >> 32); }

/* The actor id of an address, unique within its node. */
static inline uint32_t sh_addr_actor(sh_addr a) { return (uint32_t)(a & 0xffffffffu); }

#ifdef __cplusplus
}
#endif

#endif
