/* Shoal's public embedding API. Everything a host program may rely on is declared under
 * include/; nothing else in the tree is API. The engine API (sh_engine, sh_poll) arrives with the
 * serving issues; for now this header gathers the version and error contract. */
#ifndef SHOAL_H
#define SHOAL_H

#include "shoal/err.h"
#include "shoal/version.h"

#endif
